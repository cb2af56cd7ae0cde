"""Checks ``LaunchEngine`` runs before any worker starts.

Every mistake the master can see from the configuration alone fails here, at
once, as one ``PreflightError`` line naming the model and the field or path,
instead of later as a worker's traceback:

- a checkpoint path that is missing or not a directory (``ModelConfig.checkpoint``,
  ``loading.load_causal_lm``'s ``path``, ``from_pretrained``'s
  ``pretrained_model_name_or_path`` when it is a local path, or any
  ``path``/``checkpoint``-like keyword that names a missing file);
- a Hugging Face hub id there instead (``org/name[@rev][:FILE.gguf]``, ``hub.py``) that cannot be had: resolved
  here, once, through huggingface_hub's cache, and the config names the local path from then on;
- a ``.gguf`` file there instead (``ModelConfig.checkpoint``, a loader's ``path``) that is not GGUF, is
  truncated, or holds an architecture or tensor type that cannot be read, or a conversion cache that
  cannot be written. A good one is converted here, once (``storage/gguf.py``): the config names the
  converted checkpoint directory from then on, which the workers read like any other;
- a causal-LM loader pointed at an architecture the engine cannot shard (the
  checkpoint's ``config.json`` ``model_type``);
- attention heads, key/value heads, hidden or FFN sizes not divisible by the
  TP degree, fewer layers than pipeline stages (from ``config.json``, or what a
  ``model_fn`` registered with ``loading.describe_model_fn`` says it builds);
- a ``dtype`` argument of ``load_causal_lm`` (or a registered ``model_fn``) outside ``loading.DTYPES``;
- a checkpoint's ``generation_config.json`` that is not JSON or has a field of the wrong type or range;
- ``device='cuda'`` / ``backend='nccl'`` without CUDA, or fewer GPUs than workers on this node;
- a fixed ``master_port`` already in use (spawn mode, the node that hosts the rendezvous);
  ``reserve_port`` does the same for a server's HTTP port (``computron serve``), and holds it;
- a ``model_fn``, keyword argument, ``tp_plan`` or batch manager that cannot be
  pickled (spawn mode sends them to the workers);
- several nodes, and this host's name resolving to a loopback address (Debian's ``127.0.1.1 <hostname>``)
  with neither ``GLOO_SOCKET_IFNAME`` nor ``NCCL_SOCKET_IFNAME`` set (``loopback_host_problem``): gloo
  would tell the other nodes an address they cannot reach, and the rendezvous would wait in vain.

Nothing here builds a model: it reads ``config.json`` files and binds one socket (and converts a ``.gguf``
file not converted before, and fetches a hub id the cache lacks where the network allows).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import socket
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from .config import EngineConfig, ModelConfig
from .errors import GGUFError, HubError, LaunchError

# keyword arguments of a model_fn that name a file or directory on disk
_PATH_KEYS = ("path", "checkpoint", "checkpoint_path", "ckpt", "ckpt_path", "model_path", "checkpoint_dir",
              "pretrained_model_name_or_path")


class PreflightError(LaunchError, ValueError):
    """A configuration mistake found before any worker started (one line naming the model and field)."""


def supported_families() -> List[str]:
    """The transformers ``model_type`` values whose causal LMs the engine can shard (``models.families``)."""
    from .models.families import CAUSAL_LM, model_types
    return sorted(model_types(CAUSAL_LM))


def check(config: EngineConfig, model_configs: Iterable[ModelConfig], tp: int, pp: int, n_nodes: int = 1,
          node_rank: int = 0, attach: Optional[bool] = None) -> None:
    """Raise ``PreflightError`` for the first mistake found; return None when all is well."""
    if attach is None:
        attach = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    _warn_if_in_event_loop()
    _check_device(config, tp * pp, n_nodes, attach)
    nodes = _attach_nodes(os.environ) if attach else n_nodes
    if nodes > 1:
        host = socket.gethostname()
        problem = loopback_host_problem(nodes, host, _resolve(host), os.environ)
        if problem:
            raise PreflightError(problem)
    for mc in model_configs:
        _check_model(mc, tp, pp)
    if not attach:
        if node_rank == 0 and config.master_port:
            _check_port(config.master_host, config.master_port)
        for mc in model_configs:
            _check_picklable(mc)


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_host_problem(n_nodes: int, hostname: str, addresses: Sequence[str],
                          env: Mapping[str, str]) -> Optional[str]:
    """Why several nodes cannot connect from this host, or None: its name resolves first (``addresses``, in
    resolution order: gloo takes the first) to loopback, and no ``*_SOCKET_IFNAME`` names the interface."""
    if n_nodes <= 1 or not addresses or any(env.get(v) for v in SOCKET_IFNAME_VARS):
        return None
    first = addresses[0]
    if not (first.startswith("127.") or first == "::1"):
        return None
    return (f"{n_nodes} nodes, but this host's name {hostname!r} resolves to the loopback address {first} (as "
            "Debian's /etc/hosts line '127.0.1.1 <hostname>' makes it): the other nodes could not connect to "
            "it and the rendezvous would wait in vain. Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME with "
            "GPUs) to the network interface that reaches the other nodes, e.g. GLOO_SOCKET_IFNAME=eth0, on "
            "every node, or make the host name resolve to that interface's address")


def _resolve(hostname: str) -> List[str]:
    """The host name's addresses in resolution order (none where it does not resolve)."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(i[4][0] for i in infos))


def _attach_nodes(env: Mapping[str, str]) -> int:
    """How many nodes a launcher (torchrun, ``colossalai run``) started: its world over this node's part."""
    try:
        return max(1, int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError, ZeroDivisionError):
        return 1


def check_added(mc: ModelConfig, tp: int, pp: int) -> None:
    """A model added while serving: the same checks, and the same one-line errors, as at launch (it always
    travels to the workers pickled)."""
    if not isinstance(mc, ModelConfig):
        raise PreflightError(f"expected a ModelConfig, got {type(mc).__name__}")
    _check_model(mc, tp, pp)
    _check_picklable(mc)


def check_adapters(config: EngineConfig, adapters: List[ModelConfig], models: List[ModelConfig]) -> None:
    """LoRA adapters given at launch: each names a base among ``models`` and fits it (``lora.adapter``)."""
    by_id = {mc.model_id: mc for mc in models}
    for mc in adapters:
        if mc.base not in by_id:
            raise PreflightError(f"adapter {mc.model_id!r}: its base {mc.base!r} is not among the models "
                                 f"served ({sorted(by_id)})")
        from .lora.adapter import AdapterError, check_adapter_config
        try:
            check_adapter_config(mc, by_id[mc.base], config.max_lora_rank)
        except AdapterError as exc:
            raise PreflightError(str(exc)) from None


def _warn_if_in_event_loop() -> None:
    import asyncio
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    logging.getLogger("computron.launch").warning(
        "LaunchEngine was called inside a running event loop, which it blocks for the whole start-up "
        "(every worker builds every model): use `await asyncio.to_thread(LaunchEngine, ...)`")


# ---- devices and ports ----------------------------------------------------------

def _check_device(config: EngineConfig, n_workers: int, n_nodes: int, attach: bool) -> None:
    wants_cuda = config.device == "cuda" or config.backend == "nccl"
    if not wants_cuda and config.device is not None:
        return
    import torch
    if not torch.cuda.is_available():
        if wants_cuda:
            field = "device" if config.device == "cuda" else "backend"
            raise PreflightError(
                f"EngineConfig.{field}={getattr(config, field)!r}, but torch finds no CUDA device (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda}); use device=None to pick cpu + gloo "
                "automatically, or device='cpu'")
        return
    if attach:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", n_workers)))
    else:
        local = n_workers // n_nodes
    found = torch.cuda.device_count()
    if found < local:
        raise PreflightError(f"{local} workers on this node need one GPU each; torch finds {found} "
                             "(lower tp_world_size * pp_world_size, or CUDA_VISIBLE_DEVICES)")


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound (not listening) to ``host:port`` with SO_REUSEADDR, as servers bind theirs: it
    fails only where a socket already listens, not for connections lingering in TIME_WAIT.

    Its protocol is named (``IPPROTO_TCP``, not 0) because asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on accepted connections that say so: without it, on a kept-alive connection a
    streamed answer's first chunk waited for the client's delayed ACK of the headers, 45 ms added to every
    time to first token (``tests/unit/test_preflight.py``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except BaseException:  # any way out: the socket is closed; re-raised
        s.close()
        raise
    return s


def _check_port(host: str, port: int) -> None:
    try:
        _bind(host, port).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PreflightError(f"EngineConfig.master_port={port}: already in use on {host}; pick another "
                                 "port, or master_port=0 for a free one (single node)") from None
        # another address family or a remote host name: the rendezvous will tell


def reserve_port(host: str, port: int, field: str = "port") -> socket.socket:
    """A server's listening address, bound now (before any worker starts) and held: the caller listens on
    the returned socket once it is ready to serve, so nothing can take the port meanwhile. A port in use
    or an address this host cannot bind raises ``PreflightError`` naming ``field``."""
    try:
        return _bind(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PreflightError(f"{field}={port}: port {port} on {host} is already in use; pick another, or "
                                 "0 for a free one") from None
        raise PreflightError(f"{field}={port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


# ---- models ----------------------------------------------------------------------

def _from_pretrained_class(fn) -> Optional[type]:
    """The class whose ``from_pretrained`` ``fn`` is, else None."""
    owner = getattr(fn, "__self__", None)
    if getattr(fn, "__name__", "") == "from_pretrained" and isinstance(owner, type):
        return owner
    return None


def _looks_local(path: str) -> bool:
    """Whether a from_pretrained argument is meant as a local path rather than a hub id."""
    # hub ids are "name" or "org/name"; deeper paths, absolute or relative ones, or a parent that exists here are local
    return (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
            or bool(os.path.dirname(path)) and os.path.isdir(os.path.dirname(path)))


CHECKPOINT_FIELD = "ModelConfig.checkpoint"


def _label(key: str) -> str:
    return key if key == CHECKPOINT_FIELD else f"model_kwargs[{key!r}]"


def _read_config(mid: str, key: str, path: str) -> Dict[str, Any]:
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise PreflightError(f"model {mid!r}: {_label(key)}={path!r} has no config.json: "
                             "not a transformers checkpoint directory (save_pretrained writes one)")
    try:
        with open(cfg) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise PreflightError(f"model {mid!r}: cannot read {cfg}: {exc}") from None


def _check_dir(mid: str, key: str, path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise PreflightError(f"model {mid!r}: {_label(key)}={path!r}: expected a checkpoint directory path")
    path = os.fspath(path)
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise PreflightError(f"model {mid!r}: checkpoint directory {_label(key)}={path!r} does not exist "
                             f"({full}); write one with computron.zoo.save_random_causal_lm or save_pretrained")
    if not os.path.isdir(full):
        raise PreflightError(f"model {mid!r}: {_label(key)}={path!r} is a file, not a checkpoint directory")
    return full


def _convert_gguf(mc: ModelConfig) -> None:
    """A ``.gguf`` file as ``ModelConfig.checkpoint`` or as the ``path`` of a loader of ``loading``: converted
    (``storage.gguf.convert``, cached) in the dtype the loader is asked for, and the config changed in place to
    name the converted directory, so that everything after (these checks, the workers) sees a checkpoint
    directory."""
    from .loading import CHECKPOINT_LOADERS, DTYPES
    from .storage import gguf
    kw = mc.model_kwargs
    loader = any(mc.model_fn is f for f in CHECKPOINT_LOADERS)
    dtype = kw.get("dtype") if loader else None
    if dtype is not None and dtype not in DTYPES and (gguf.is_gguf(kw.get("path")) or gguf.is_gguf(mc.checkpoint)):
        raise PreflightError(f"model {mc.model_id!r}: model_kwargs['dtype']={dtype!r}: must be one of "
                             f"{sorted(DTYPES)} or None")
    try:
        if loader and gguf.is_gguf(kw.get("path")):
            mc.model_kwargs = {**kw, "path": gguf.convert(kw["path"], dtype)}
        if gguf.is_gguf(mc.checkpoint):
            mc.checkpoint = gguf.convert(mc.checkpoint, dtype)
    except GGUFError as exc:
        raise PreflightError(f"model {mc.model_id!r}: {exc}") from None


def _check_model(mc: ModelConfig, tp: int, pp: int) -> None:
    from . import hub
    from .loading import CHECKPOINT_LOADERS
    try:
        hub.resolve_config(mc, CHECKPOINT_LOADERS)
    except HubError as exc:
        raise PreflightError(f"model {mc.model_id!r}: {exc}") from None
    _convert_gguf(mc)
    mid, fn, kw = mc.model_id, mc.model_fn, mc.model_kwargs
    if mc.checkpoint is not None:  # read slice by slice on the workers: it must be there now
        _read_config(mid, CHECKPOINT_FIELD, _check_dir(mid, CHECKPOINT_FIELD, mc.checkpoint))
    hf_cfg: Optional[Dict[str, Any]] = None
    causal_loader = False
    source = ""
    cls = _from_pretrained_class(fn)
    from .loading import DTYPES, described_config, load_causal_lm, takes_dtype_name
    if fn is load_causal_lm:
        causal_loader = True
        if "path" not in kw:
            raise PreflightError(f"model {mid!r}: load_causal_lm needs model_kwargs['path'] "
                                 "(a local checkpoint directory)")
        hf_cfg = _read_config(mid, "path", _check_dir(mid, "path", kw["path"]))
        source = f"checkpoint {kw['path']!r}"
    elif cls is not None:
        causal_loader = "CausalLM" in cls.__name__
        key = "pretrained_model_name_or_path"
        path = kw.get(key)
        if isinstance(path, (str, os.PathLike)):
            path = os.fspath(path)
            if os.path.isdir(os.path.expanduser(path)) or _looks_local(path):  # else a hub id (maybe cached)
                hf_cfg = _read_config(mid, key, _check_dir(mid, key, path))
                source = f"checkpoint {path!r}"
    else:
        described = described_config(fn, kw)
        if described is not None:
            hf_cfg, source = described
        for key in _PATH_KEYS:  # any model_fn: a path argument that names nothing fails here, not on a worker
            v = kw.get(key)
            if isinstance(v, (str, os.PathLike)) and not os.path.exists(os.path.expanduser(os.fspath(v))):
                raise PreflightError(f"model {mid!r}: model_kwargs[{key!r}]={os.fspath(v)!r} does not exist")
    if takes_dtype_name(fn) and kw.get("dtype") is not None and kw["dtype"] not in DTYPES:
        raise PreflightError(f"model {mid!r}: model_kwargs['dtype']={kw['dtype']!r}: must be one of "
                             f"{sorted(DTYPES)} or None")
    _check_generation_config(mc)
    if hf_cfg is None:
        return
    bm_vocab = getattr(mc.batch_manager, "vocab_size", None)
    vocab = hf_cfg.get("vocab_size")
    if isinstance(bm_vocab, int) and isinstance(vocab, int) and bm_vocab > vocab:
        raise PreflightError(f"model {mid!r}: ModelConfig.batch_manager.vocab_size={bm_vocab} exceeds the {source}'s "
                             f"vocab_size={vocab} (it would let out-of-range ids through): leave batch_manager=None "
                             "to have one built from the checkpoint, or build it with for_config of that config")
    model_type = hf_cfg.get("model_type")
    from .models.families import GENERIC_HINT, PLAN_DECODERS, serves_causal_lm
    if causal_loader and not serves_causal_lm(hf_cfg):
        raise PreflightError(
            f"model {mid!r}: {source} is a {model_type!r} causal LM, which the engine cannot shard (supported: "
            f"model_type {', '.join(supported_families())} and {PLAN_DECODERS}); {GENERIC_HINT}")
    _check_shape(mid, source, hf_cfg, tp, pp)


def _check_generation_config(mc: ModelConfig) -> None:
    """The checkpoint's generation_config.json, when it has one, must be readable: its EOS ids and
    defaults join the model's batch manager on the master (``batching.generation``)."""
    from .loading import checkpoint_of
    where = checkpoint_of(mc)
    if where is None or not os.path.isdir(where[0]):
        return
    from .batching.generation import GenerationConfigError, read_generation_config
    try:
        read_generation_config(where[0])
    except GenerationConfigError as exc:
        raise PreflightError(f"model {mc.model_id!r}: {exc}") from None


def _check_shape(mid: str, source: str, c: Dict[str, Any], tp: int, pp: int) -> None:
    text = c.get("text_config") if isinstance(c.get("text_config"), dict) else c
    if tp > 1:
        from .models.families import check_tp_divisible, tp_fields_of_any_family
        from .models.plans import check_tp, decoder_plan
        try:
            if text.get("model_type") != "opt" and decoder_plan(text) is not None:
                check_tp(text, tp, mid, source)
            else:  # which runner will serve it is not known yet: every field some family splits
                check_tp_divisible(text, tp_fields_of_any_family(), tp, mid, source)
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and layers < pp:
        raise PreflightError(f"model {mid!r}: {source} has num_hidden_layers={layers}, fewer than "
                             f"pp_world_size={pp} pipeline stages")


def _check_picklable(mc: ModelConfig) -> None:
    mid = mc.model_id
    parts = [("model_fn", mc.model_fn)] + [(f"model_kwargs[{k!r}]", v) for k, v in mc.model_kwargs.items()]
    parts.append(("tp_plan", mc.tp_plan))  # the batch manager stays on the master
    for field, value in parts:
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - PicklingError, AttributeError, TypeError all mean the same
            what = getattr(value, "__qualname__", None) or type(value).__name__
            raise PreflightError(
                f"model {mid!r}: ModelConfig.{field} ({what}) cannot be pickled, and spawn mode sends it to "
                f"every worker: use a module-level function or picklable values, not a lambda or a local "
                f"function ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
