"""Production loading of local checkpoints: the loaders ``computron serve`` names, dtypes, tokenizer files.

Every fact here has one home: the dtype names a checkpoint may be loaded in
(``DTYPES``, also the server's ``--dtype`` choices), the files that make a
directory hold a tokenizer (``TOKENIZER_FILES``), and which of these loaders
read a checkpoint directory named by their ``path`` argument
(``loader_checkpoint``; ``checkpoint_of`` adds ``ModelConfig.checkpoint``: what ``checkpoint`` reads slice by slice).
transformers downloads nothing: every loader passes ``local_files_only``. A loader's ``path`` may be a hub id
(``org/name``, ``org/name@rev``, ``org/name:FILE.gguf``), resolved through huggingface_hub's cache by ``hub.py``
(the engine's preflight does it once on the master, so the workers get the local path).

The random-weight fixtures that write such checkpoints live in
:mod:`computron.testing`. Importing this module does not import torch (the CLI
reads ``DTYPES`` for ``--help``); the loaders import it when called.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Optional, Tuple

from . import hub

DTYPES = ("float32", "float16", "bfloat16")
"""dtype names a model may be loaded in; each is also the name of the torch dtype."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model")
"""Files of which any one lets ``AutoTokenizer.from_pretrained`` load a tokenizer from a directory
(fast tokenizers, SentencePiece models, WordPiece and BPE vocabularies)."""


def torch_dtype(name: str, where: str = "dtype"):
    """The torch dtype called ``name`` (one of ``DTYPES``); ``ValueError`` naming ``where`` otherwise."""
    if name not in DTYPES:
        raise ValueError(f"{where}: dtype={name!r}: must be one of {sorted(DTYPES)}")
    import torch
    return getattr(torch, name)


def checkpoint_dtype(path: str) -> Optional[str]:
    """The dtype name a checkpoint's config.json records (``dtype``, or the older ``torch_dtype``), or None."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("dtype") or cfg.get("torch_dtype")


def has_tokenizer(path: str) -> bool:
    """Whether the directory ``path`` holds tokenizer files (any of ``TOKENIZER_FILES``)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def architecture_class(config) -> Optional[type]:
    """The transformers class a config's ``architectures[0]`` names, or None."""
    import transformers
    arch = (getattr(config, "architectures", None) or [None])[0]
    return getattr(transformers, arch, None) if arch else None


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def _dtype_kwargs(dtype: Optional[str], where: str) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = torch_dtype(dtype, where)
    return kwargs


def load_causal_lm(path: str, dtype: Optional[str] = None):
    """Load a local causal-LM checkpoint directory: the ``model_fn`` of ``computron serve`` and of the examples.
    A hub id that names no local path is resolved first (``hub.resolve``: ``HubError`` when it cannot be).

    ``dtype`` (``float32``, ``float16``, ``bfloat16``) converts the weights on load; None keeps the
    checkpoint's own dtype.

    ``path`` may be a ``.gguf`` file: transformers reads it here, dequantizing every tensor on each call
    (float32 unless ``dtype`` says otherwise). Through the engine (``ModelConfig``) or ``computron serve`` the
    master writes its config and tokenizer once instead (``storage/gguf.py``) and the workers read the
    file's blocks as they are (``storage/gguf_native.py``); such a metadata directory loads its file here.
    """
    path = hub.resolve(path)
    source = os.path.join(os.fspath(path), "gguf_source.json") if isinstance(path, (str, os.PathLike)) else ""
    if source and os.path.isfile(source):
        with open(source) as f:
            path = json.load(f)["gguf"]
    if isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(".gguf") and os.path.isfile(path):
        from transformers import AutoModelForCausalLM
        _quiet_transformers()
        folder, name = os.path.split(os.path.abspath(os.fspath(path)))
        kwargs = _dtype_kwargs(dtype, f"load_causal_lm({path!r})")
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs).eval()
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        what = "is not a directory" if isinstance(path, (str, os.PathLike)) and os.path.exists(path) else \
            "does not exist"
        raise FileNotFoundError(f"load_causal_lm: checkpoint directory {path!r} {what} (nor is it a hub id: "
                                "org/name, org/name@revision, org/name:FILE.gguf)")
    from transformers import AutoModelForCausalLM
    _quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(path, **_dtype_kwargs(dtype, f"load_causal_lm({path!r})")).eval()


def load_encoder(path: str, dtype: Optional[str] = None):
    """Load a local encoder/ViT checkpoint with the class its config names (a hub id is resolved first, as
    ``load_causal_lm`` does): a ``model_fn``."""
    path = hub.resolve(path)
    from transformers import AutoConfig
    _quiet_transformers()
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    cls = architecture_class(config)
    if cls is None:
        raise ValueError(f"checkpoint {path!r}: config.architectures={config.architectures!r} names no "
                         "transformers class")
    return cls.from_pretrained(path, **_dtype_kwargs(dtype, f"load_encoder({path!r})")).eval()


CHECKPOINT_LOADERS: Tuple[Callable, ...] = (load_causal_lm, load_encoder)
"""The loaders whose ``path`` and ``dtype`` arguments fully describe what they build."""


def loader_checkpoint(model_fn: Callable, kwargs: Dict[str, Any]) -> Optional[Tuple[str, Optional[str]]]:
    """``(path, dtype or None)`` when ``model_fn(**kwargs)`` is one of ``CHECKPOINT_LOADERS`` reading a local
    directory (or a hub id the preflight resolves into one); None for any other function, or for arguments
    whose meaning is not known here."""
    if not any(model_fn is f for f in CHECKPOINT_LOADERS) or not isinstance(kwargs.get("path"), (str, os.PathLike)):
        return None
    if set(kwargs) - {"path", "dtype"}:
        return None
    return os.fspath(kwargs["path"]), kwargs.get("dtype")


ConfigOf = Callable[[Dict[str, Any]], Optional[Tuple[Dict[str, Any], str]]]
_MODEL_FNS: Dict[Callable, Tuple[Optional[ConfigOf], bool]] = {load_causal_lm: (None, True)}


def describe_model_fn(model_fn: Callable, config_of: Optional[ConfigOf] = None, dtype_arg: bool = False) -> None:
    """Tell the preflight what ``model_fn`` builds without calling it: ``config_of(model_kwargs)`` gives
    ``(its transformers config as a dict, a phrase naming where it comes from)`` or None when those kwargs
    are not understood; ``dtype_arg``: its ``dtype`` argument takes the names of ``DTYPES``. Model
    factories outside this module (the random-weight fixtures of ``computron.testing``) register here."""
    _MODEL_FNS[model_fn] = (config_of, dtype_arg)


def described_config(model_fn: Callable, kwargs: Dict[str, Any]) -> Optional[Tuple[Dict[str, Any], str]]:
    """``describe_model_fn``'s ``config_of`` of ``model_fn`` applied to ``kwargs`` (None when not known)."""
    config_of = _MODEL_FNS.get(model_fn, (None, False))[0]
    return config_of(kwargs) if config_of is not None else None


def takes_dtype_name(model_fn: Callable) -> bool:
    """Whether ``model_fn``'s ``dtype`` argument is one of ``DTYPES`` (``describe_model_fn``)."""
    return _MODEL_FNS.get(model_fn, (None, False))[1]


def checkpoint_of(model_config) -> Optional[Tuple[str, Optional[str]]]:
    """``(directory, dtype name or None)`` when the model's weights come from a local checkpoint, else None.

    ``ModelConfig.checkpoint`` names the directory; the dtype is the one its ``model_fn`` is asked for
    when that is a loader of ``loading`` (else None: the checkpoint's own). A config without
    ``checkpoint`` whose ``model_fn`` is such a loader is read from the loader's ``path``.
    """
    loader = loader_checkpoint(model_config.model_fn, model_config.model_kwargs or {})
    ck = getattr(model_config, "checkpoint", None)
    if ck is not None:
        return str(ck), loader[1] if loader is not None else None
    return loader


__all__ = ["DTYPES", "TOKENIZER_FILES", "torch_dtype", "checkpoint_dtype", "has_tokenizer", "architecture_class",
           "load_causal_lm", "load_encoder", "CHECKPOINT_LOADERS", "loader_checkpoint", "checkpoint_of",
           "describe_model_fn", "described_config", "takes_dtype_name"]
