"""One served model from one config entry: the single path of ``computron serve``'s start-up and of the
models added while it serves (the repository API, a model repository's first request).

``build_model(entry)`` reads the checkpoint's ``config.json`` (and a causal LM's ``generation_config.json``:
its EOS ids and the defaults of unset request fields), loads a causal LM's tokenizer (or builds
an encoder's or ViT's batch manager), and makes the engine's ``ModelConfig`` (the loaders of
``computron.loading`` with ``checkpoint=path``, so every rank reads only its own slices). It returns a
``BuiltModel``: the server's ``ServedModel`` and that ``ModelConfig``. ``entry_for`` checks a mapping
given while serving exactly as a ``models[i]`` entry of the config file is checked.

A LoRA adapter entry (``base`` and ``adapter``) is built by ``build_adapter`` from its base's
``ServedModel``: a text generator with its base's tokenizer and positions, whose ``ModelConfig`` is the
adapter's (``ModelConfig(id, base=..., adapter=...)``). It reads no file: the engine checks the adapter
against its base's checkpoint when it is added (``lora.adapter.AdapterError``), and at start-up
``build_models`` runs that check first, naming the entry (``models[2].adapter: adapter 'x': ...``).

Everything here reads files and may take seconds (tokenizers): start-up calls it before any worker
starts; the registry calls it off the event loop (``run_in_executor``). Errors are ``ConfigError``
naming the entry and the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .config import ConfigError, ModelEntry, ServeConfig, parse_model
from .model_kind import ModelKind
from .text import ModelText

DEFAULT_MAX_BATCH_SIZE = 8
"""An encoder's batch size when neither its entry nor the engine config sets one (EngineConfig's default)."""

_REBUILD_FIELDS = ("path", "dtype", "max_batch_size", "queue_size", "task", "base", "adapter", "keep_alive")
"""The fields of an entry that only a new build can change (``pinned`` and ``priority`` are set in place)."""


@dataclass
class UnderstandingModel:
    """An encoder or ViT model the server serves, with the batch manager its engine requests go through."""
    id: str
    path: str
    kind: ModelKind
    """SEQUENCE_CLS, TOKEN_CLS, EMBEDDING or IMAGE_CLS."""
    batch_manager: Any
    hidden_size: Optional[int] = None

    def __post_init__(self):
        self.kind = ModelKind(self.kind)

    @property
    def is_text(self) -> bool:
        return self.kind is not ModelKind.IMAGE_CLS

    @property
    def tokenizer(self):
        return getattr(self.batch_manager, "tokenizer", None)

    @property
    def labels(self) -> List[str]:
        return list(getattr(self.batch_manager, "labels", []) or [])

    def input_specs(self) -> List[Dict[str, Any]]:
        bm = self.batch_manager
        if not self.is_text:
            c, h, w = bm.shape
            out = [{"name": "pixel_values", "datatype": "FP32", "shape": [-1, c, h, w]}]
            if bm.processor is not None:
                out.append({"name": "image", "datatype": "BYTES", "shape": [-1]})
            return out
        out = []
        if self.tokenizer is not None:
            out += [{"name": "text", "datatype": "BYTES", "shape": [-1]},
                    {"name": "text_pair", "datatype": "BYTES", "shape": [-1]}]
        out += [{"name": n, "datatype": "INT64", "shape": [-1, -1]}
                for n in ("input_ids", "attention_mask", "token_type_ids")]
        return out

    def output_specs(self) -> List[Dict[str, Any]]:
        n = len(self.labels)
        if self.kind is ModelKind.EMBEDDING:
            return [{"name": "embedding", "datatype": "FP32", "shape": [-1, self.hidden_size or -1]}]
        if self.kind is ModelKind.TOKEN_CLS:
            return [{"name": "label", "datatype": "BYTES", "shape": [-1, -1]},
                    {"name": "score", "datatype": "FP32", "shape": [-1, -1]},
                    {"name": "logits", "datatype": "FP32", "shape": [-1, -1, n]},
                    {"name": "length", "datatype": "INT64", "shape": [-1]}]
        return [{"name": "label", "datatype": "BYTES", "shape": [-1, -1]},
                {"name": "score", "datatype": "FP32", "shape": [-1, -1]},
                {"name": "logits", "datatype": "FP32", "shape": [-1, n]}]

    def metadata(self) -> Dict[str, Any]:
        return {"name": self.id, "versions": ["1"], "platform": "computron", "inputs": self.input_specs(),
                "outputs": self.output_specs()}


@dataclass(frozen=True)
class ServedModel:
    """One model the server serves."""
    id: str
    path: str
    kind: ModelKind
    text: Optional[ModelText] = None
    """A text generator's tokenizer."""
    understanding: Optional[UnderstandingModel] = None
    """An encoder or ViT model's batch manager and v2 metadata."""
    max_positions: Optional[int] = None
    """A text generator's positions: the default ``max_tokens`` fits in them."""
    entry: Optional[ModelEntry] = None
    """The config entry it was built from (None for models handed to ``create_app`` ready-made)."""
    base: Optional[str] = None
    """A LoRA adapter's: the id of the model whose weights and tokenizer it runs on (``path`` is then the
    adapter's directory)."""
    generation: Any = None
    """A text generator's ``batching.generation.GenerationDefaults`` (its checkpoint's generation_config.json;
    None without one): the defaults of the fields a request leaves unset."""
    eos_token_ids: Tuple[int, ...] = ()
    """A text generator's EOS ids: config.json's and generation_config.json's."""

    def same_build(self, entry: ModelEntry) -> bool:
        """Whether ``entry`` would build this very model (same checkpoint, dtype, batch and queue bounds, task)."""
        if self.entry is None:
            return entry.path == self.path and all(getattr(entry, f) is None for f in _REBUILD_FIELDS[1:])
        return all(getattr(entry, f) == getattr(self.entry, f) for f in _REBUILD_FIELDS)


@dataclass(frozen=True)
class BuiltModel:
    served: ServedModel
    config: Any
    """The engine's ``computron.config.ModelConfig``."""


def entry_for(model_id: str, raw: Dict[str, Any], where: str) -> ModelEntry:
    """``raw`` (the fields of a config file's model entry; ``id`` optional, and then ``model_id``) checked as
    ``parse_model`` checks ``models[i]``, errors naming ``where``. Reads ``config.json``: off the loop."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping with the fields of a model entry (path, dtype, ...), "
                          f"got {raw!r}")
    if raw.get("id", model_id) != model_id:
        raise ConfigError(f"{where}.id={raw['id']!r}: differs from the model name {model_id!r}")
    return parse_model({**raw, "id": model_id}, where)


def build_model(entry: ModelEntry, default_max_batch_size: Optional[int] = None,
                where: Optional[str] = None) -> BuiltModel:
    """The ``ServedModel`` and ``ModelConfig`` of a checked entry (``parse_model``) with a checkpoint;
    ``ConfigError`` naming ``where`` (default: the model id) when its config.json, tokenizer or batch
    manager cannot be read. (An adapter entry: ``build_adapter``.)"""
    if entry.adapter is not None:
        raise ValueError(f"build_model: {entry.id!r} is a LoRA adapter: build_adapter builds it on its base")
    from transformers import AutoConfig

    from ..config import ModelConfig
    from ..batching.causal_lm import CausalLMBatchManager
    from ..batching.generation import GenerationConfigError
    from ..loading import load_causal_lm, load_encoder
    where = where or f"model {entry.id!r}"
    try:
        hf = AutoConfig.from_pretrained(entry.path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{where}.path: {entry.path!r}: cannot read config.json: {exc}") from None
    kwargs: Dict[str, Any] = {"path": entry.path}
    if entry.dtype is not None:
        kwargs["dtype"] = entry.dtype
    common = dict(checkpoint=entry.path, queue_size=entry.queue_size, pinned=entry.pinned, priority=entry.priority,
                  keep_alive=entry.keep_alive, quantization=getattr(entry, "quantization", None))
    if entry.kind not in (None, ModelKind.GENERATION):
        und = _understanding_model(entry, hf, default_max_batch_size, where)
        config = ModelConfig(entry.id, load_encoder, kwargs, batch_manager=und.batch_manager, **common)
        return BuiltModel(ServedModel(entry.id, entry.path, und.kind, understanding=und, entry=entry), config)
    try:
        text = ModelText(entry.id, entry.path)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{where}.path: {entry.path!r}: cannot load its tokenizer: "
                          f"{type(exc).__name__}: {exc}") from None
    try:
        generation, eos = generation_of(entry.path, getattr(hf, "eos_token_id", None))
    except GenerationConfigError as exc:
        raise ConfigError(f"{where}.path: {exc}") from None
    n = getattr(hf, "max_position_embeddings", None)
    bm = None
    if entry.max_batch_size is not None:
        bm = CausalLMBatchManager.for_config(hf, max_batch_size=entry.max_batch_size, generation=generation,
                                             tokenizer_path=entry.path)
    config = ModelConfig(entry.id, load_causal_lm, kwargs, batch_manager=bm, **common)
    served = ServedModel(entry.id, entry.path, ModelKind.GENERATION, text=text,
                         max_positions=n if isinstance(n, int) else None, entry=entry, generation=generation,
                         eos_token_ids=eos)
    return BuiltModel(served, config)


def generation_of(path: str, config_eos: Any = None) -> Tuple[Any, Tuple[int, ...]]:
    """A causal LM checkpoint's generation_config.json as ``GenerationDefaults`` (None without one) and its
    EOS ids with config.json's ``config_eos``; ``GenerationConfigError`` naming the file and field."""
    from ..batching.generation import merge_eos, read_generation_config
    generation = read_generation_config(path)
    return generation, tuple(merge_eos(config_eos, generation.eos_token_id if generation else None))


def _understanding_model(entry: ModelEntry, hf, default_max_batch_size: Optional[int],
                         where: str) -> UnderstandingModel:
    """The batch manager (``computron.batching.text`` or ``computron.batching.images``) of an encoder or ViT entry,
    wrapped for the v2 routes."""
    from ..batching.images import ImageClassificationBatchManager
    from ..batching.text import EmbeddingBatchManager, TextClassificationBatchManager
    cls = {ModelKind.EMBEDDING: EmbeddingBatchManager, ModelKind.IMAGE_CLS: ImageClassificationBatchManager}.get(
        entry.kind, TextClassificationBatchManager)
    bs = entry.max_batch_size or default_max_batch_size or DEFAULT_MAX_BATCH_SIZE
    try:
        bm = cls.for_checkpoint(entry.path, max_batch_size=bs)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{where}.path: {entry.path!r}: cannot build its {entry.kind} batch manager: "
                          f"{type(exc).__name__}: {exc}") from None
    return UnderstandingModel(entry.id, entry.path, entry.kind, bm, hidden_size=getattr(hf, "hidden_size", None))


def build_adapter(entry: ModelEntry, base: ServedModel, where: Optional[str] = None) -> BuiltModel:
    """A LoRA adapter entry on the served model ``base`` (see the module docstring); ``ConfigError``
    naming ``where.base`` when ``base`` is not a causal LM of its own."""
    from ..config import ModelConfig
    where = f"{where or f'model {entry.id!r}'}.base={entry.base!r}"
    if base.base is not None:
        raise ConfigError(f"{where}: an adapter itself (on {base.base!r}); adapters run on a model's weights")
    if base.kind is not ModelKind.GENERATION or base.text is None:
        raise ConfigError(f"{where}: a {base.kind} model; LoRA adapters run on causal LMs")
    config = ModelConfig(entry.id, base=base.id, adapter=entry.adapter)
    served = ServedModel(entry.id, entry.adapter, ModelKind.GENERATION, text=base.text,
                         max_positions=base.max_positions, entry=entry, base=base.id, generation=base.generation,
                         eos_token_ids=base.eos_token_ids)
    return BuiltModel(served, config)


def check_adapter_files(adapter: BuiltModel, base: BuiltModel, max_rank: int, where: str) -> None:
    """The engine's own check of an adapter's files against its base's checkpoint (rank, targets, shapes),
    before any worker starts: ``ConfigError`` naming ``where.adapter``."""
    from ..lora.adapter import AdapterError, check_adapter_config
    try:
        check_adapter_config(adapter.config, base.config, max_rank)
    except AdapterError as exc:
        raise ConfigError(f"{where}.adapter: {exc}") from None


def build_models(cfg: ServeConfig) -> List[BuiltModel]:
    """Every model of the config file, in its order, before any worker starts: the checkpoints
    (``build_model``), then the adapters on them (``build_adapter``, their files checked)."""
    built: Dict[str, BuiltModel] = {}
    for i, m in enumerate(cfg.models):
        if m.adapter is None:
            built[m.id] = build_model(m, cfg.engine.max_batch_size, f"models[{i}]")
    for i, m in enumerate(cfg.models):
        if m.adapter is not None:  # parse_models checked that its base is a causal LM of the file
            built[m.id] = build_adapter(m, built[m.base].served, f"models[{i}]")
            check_adapter_files(built[m.id], built[m.base], cfg.engine.max_lora_rank, f"models[{i}]")
    return [built[m.id] for m in cfg.models]
