"""``ModelConfig``: one served model's settings, and the checks of a launch's model list and world."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

from ..sched.keep_alive import parse_keep_alive
from .fields import _fail


@dataclass
class ModelConfig:
    model_id: str
    """Name requests use to reach this model."""
    model_fn: Optional[Callable[..., Any]] = None
    """Builds the full (unsharded) torch module on each rank; must be picklable (a module-level function).
    Required, except for an adapter (``adapter``)."""
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of model_fn."""
    batch_manager: Any = None
    """A BatchManager; None makes batches of one request (a causal LM gets a CausalLMBatchManager). It
    stays on the master with its tokenizers: workers never receive it (``for_workers``)."""
    pipelinable: bool = True
    """Whether the model may be split into pipeline stages (the paper's flag); False with pp > 1 fails the launch."""
    tp_plan: Optional[Dict[str, Any]] = None
    """A torch.distributed.tensor.parallel plan (module path -> ParallelStyle) for custom modules."""
    mutable_buffers: Sequence[str] = ()
    """Names of buffers a forward changes; only these are copied back on offload."""
    pinned: bool = False
    """Never evict this model once loaded (it still counts against max_loaded and the device budget). On CPU
    workers its Linears then run on packed weights (``EngineConfig.pack_cpu_linears='pinned'``, the default)."""
    priority: int = 0
    """Higher goes first when several models wait for a slot, and is evicted last."""
    queue_size: Optional[int] = None
    """This model's bound on waiting requests (QueueFullError over it); None takes EngineConfig.queue_size,
    0 is unbounded."""
    keep_alive: Any = None
    """How long this model stays resident once idle (``EngineConfig.keep_alive``'s forms); None: the engine's."""
    checkpoint: Optional[str] = None
    """A local transformers checkpoint directory (safetensors) of a causal LM or encoder family the
    runners split: each rank then builds the model on the meta device and reads only its own slices of
    the tensors its stage and TP rank hold, and may leave them on disk beyond
    ``EngineConfig.host_budget``. ``model_fn`` is still required: it builds the model when the
    directory cannot be read this way (no safetensors, another architecture). A ``model_fn`` that is
    ``loading.load_causal_lm`` or ``loading.load_encoder`` with a ``path`` is read this way too.

    A ``.gguf`` file may stand for the directory (here or as the loader's ``path``): the master converts it
    before any worker starts, once (cached, ``storage/gguf.py``), and this field then names the converted
    directory. So may a Hugging Face hub id (``org/name``, ``org/name@rev``, ``org/name:FILE.gguf``) that names
    no local path: the preflight resolves it through huggingface_hub's cache (``hub.py``) into the local path."""
    quantization: Optional[str] = None
    """Weight-only quantization of a float checkpoint at load (``quant/``): ``"int8"``, ``"int4"`` or
    ``"int4-gG"`` (G = 32, 64, 128, 256); the layers' Linears are parked and swapped packed."""
    quant_compute: Optional[str] = None
    """``"expand"`` (dequantized on arrival) or ``"packed"`` (torch's int8/int4 matmuls); None: the default."""
    base: Optional[str] = None
    """With ``adapter``: the id of the served causal LM whose weights the adapter runs on."""
    adapter: Optional[str] = None
    """A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``): this id
    serves that adapter on ``base``'s weights. Its requests are its base's as far as swapping goes (one
    load serves them all), and sequences of different adapters share a step. No ``model_fn``."""

    def __post_init__(self):
        c = "ModelConfig"
        if not isinstance(self.model_id, str) or not self.model_id:
            _fail(c, "model_id", self.model_id, "must be a non-empty string")
        if self.adapter is not None or self.base is not None:
            import os
            if not isinstance(self.adapter, (str, os.PathLike)) or not str(self.adapter):
                _fail(c, "adapter", self.adapter, "must be a PEFT adapter directory when base is given")
            if not isinstance(self.base, str) or not self.base:
                _fail(c, "base", self.base, "must name the served model the adapter runs on")
            if self.model_fn is not None or self.checkpoint is not None:
                _fail(c, "model_fn", self.model_fn, "an adapter has no model_fn or checkpoint of its own "
                      "(its base's weights serve it)")
            self.adapter = os.fspath(self.adapter)
        elif not callable(self.model_fn):
            _fail(c, "model_fn", self.model_fn, "must be callable")
        if not isinstance(self.model_kwargs, dict):
            _fail(c, "model_kwargs", self.model_kwargs, "must be a dict")
        if self.batch_manager is not None:
            for attr in ("make_batch", "split_batch"):
                if not callable(getattr(self.batch_manager, attr, None)):
                    _fail(c, "batch_manager", self.batch_manager, f"has no {attr}() method")
        self.mutable_buffers = tuple(self.mutable_buffers)
        if not isinstance(self.pinned, bool):
            _fail(c, "pinned", self.pinned, "must be True or False")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            _fail(c, "priority", self.priority, "must be an int")
        if self.queue_size is not None and (not isinstance(self.queue_size, int) or isinstance(self.queue_size, bool)
                                            or self.queue_size < 0):
            _fail(c, "queue_size", self.queue_size, "must be None or an int >= 0 (0 = unbounded)")
        self.keep_alive = None if self.keep_alive is None else parse_keep_alive(self.keep_alive, f"{c}.keep_alive")
        if self.checkpoint is not None:
            import os
            if not isinstance(self.checkpoint, (str, os.PathLike)) or not str(self.checkpoint):
                _fail(c, "checkpoint", self.checkpoint, "must be a directory path (str), a .gguf file, a hub id "
                      "or None")
            self.checkpoint = os.fspath(self.checkpoint)
        from ..quant.names import check_quantization
        check_quantization(self.quantization, self.quant_compute)

    def for_workers(self) -> "ModelConfig":
        """What a worker needs to build its shard: this config without the master's batch manager."""
        return replace(self, batch_manager=None)


def check_model_configs(model_configs: Iterable[ModelConfig], allow_empty: bool = False) -> list:
    """The configs as a list, or ValueError; ``allow_empty`` lets an engine start with no model (models can
    be added while it serves: ``Engine.add_model``)."""
    configs = list(model_configs)
    if not configs and not allow_empty:
        raise ValueError("model_configs: at least one ModelConfig is needed")
    seen = set()
    for mc in configs:
        if not isinstance(mc, ModelConfig):
            raise ValueError(f"model_configs: expected ModelConfig, got {type(mc).__name__}")
        if mc.model_id in seen:
            raise ValueError(f"model_configs: duplicate model_id {mc.model_id!r}")
        seen.add(mc.model_id)
    return configs


def check_world(tp_world_size: int, pp_world_size: int, n_nodes: int, node_rank: int) -> None:
    for name, v, lo in (("tp_world_size", tp_world_size, 1), ("pp_world_size", pp_world_size, 1),
                        ("n_nodes", n_nodes, 1), ("node_rank", node_rank, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name}={v!r}: must be an int >= {lo}")
    if node_rank >= n_nodes:
        raise ValueError(f"node_rank={node_rank}: must be < n_nodes={n_nodes}")
    if (tp_world_size * pp_world_size) % n_nodes:
        raise ValueError(f"tp_world_size*pp_world_size={tp_world_size * pp_world_size} "
                         f"must be divisible by n_nodes={n_nodes}")
