"""Hugging Face hub ids as checkpoints: ``ORG/NAME[@REVISION][:FILE.gguf]`` resolved, once and on the master,
to a directory or file of huggingface_hub's cache.

Wherever a checkpoint directory or a ``.gguf`` file goes (``computron serve ID=PATH``, a YAML model's ``path``,
``ModelConfig.checkpoint``, the ``path`` of ``loading.load_causal_lm`` / ``load_encoder``), a hub id may go:

- ``org/name``: the repository's snapshot of its default branch (``main``), a transformers checkpoint
  directory (its weights, configs and tokenizer files: other formats are not fetched, see ``NOT_FETCHED``);
- ``org/name@REVISION``: a branch, tag or commit hash of it;
- ``org/name:FILE.gguf`` (or ``org/name@REVISION:FILE.gguf``): one GGUF file of the repository, which is then
  served as a local ``.gguf`` file is (``storage/gguf.py``).

A local path that exists always wins over an id, and so does a path whose first directory exists here
(``ckpt/a`` with a ``ckpt`` directory): what is neither an existing path nor an id is left as it is, for the
checks that report a missing path. The cache is huggingface_hub's: ``HF_HUB_CACHE``, else ``HF_HOME/hub``,
else ``~/.cache/huggingface/hub`` (``cache_dir``, read when an id is resolved). With ``HF_HUB_OFFLINE=1``
only the cache is read (``local_files_only``); without it, huggingface_hub fetches what the cache lacks (its
progress bars on stderr, one log line here before) and falls back on the cache when the hub cannot be
reached. Every problem is a ``HubError``, one line naming the id and the cache directory looked in: the
engine raises it as a ``PreflightError``, ``computron serve`` as a configuration error, both before any
worker starts, whose configs name the resolved local path. huggingface_hub is imported only to resolve an id.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

from .errors import HubError

log = logging.getLogger("computron.hub")

_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.-]+(?:/[\w.-]+)*?))?"
                 r"(?::(?P<filename>[^:@]+\.gguf))?", re.IGNORECASE | re.ASCII)
"""``ORG/NAME``, then ``@REVISION`` (a branch, tag or commit; ``refs/pr/1`` too), then ``:FILE.gguf``."""

NOT_FETCHED = ("*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.msgpack", "*.h5", "*.ot", "*.tflite", "*.pth",
               "*.pt", "original/*", "coreml/*", "openvino/*", "*.mlmodel")
"""Files of a repository's snapshot not fetched: formats no loader here reads (a GGUF file is named on its own:
``org/name:FILE.gguf``)."""

PICKLED_WEIGHTS = ("*.bin",)
"""``pytorch_model*.bin`` weights: fetched only when the snapshot holds no ``.safetensors`` file."""

_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubRef:
    """One hub id, parsed."""
    repo_id: str
    revision: Optional[str] = None
    """None: the default branch."""
    filename: Optional[str] = None
    """A ``.gguf`` file inside the repository (a path relative to its root), or None for the snapshot."""

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + \
            (f":{self.filename}" if self.filename else "")

    @property
    def model_id(self) -> str:
        """The id ``computron serve`` gives it when no ``ID=`` names one: the repository's name, or the GGUF
        file's without ``.gguf``."""
        if self.filename:
            return os.path.basename(self.filename)[:-len(".gguf")]
        return self.repo_id.split("/", 1)[1]


def parse(text: Any) -> Optional[HubRef]:
    """The hub id ``text`` spells, or None (not a string, or not of the form ``ORG/NAME[@REVISION][:FILE.gguf]``).
    Says nothing of whether a local path of that name exists: ``is_hub_id`` does."""
    if not isinstance(text, str):
        return None
    m = _ID.fullmatch(text)
    if m is None or ".." in m.group("repo") or (m.group("revision") or "").startswith("."):
        return None
    return HubRef(m.group("repo"), m.group("revision"), m.group("filename"))


def is_hub_id(path: Any) -> bool:
    """Whether ``path`` is to be resolved on the hub: an id (``parse``) that names no local path, whose first
    directory does not exist here either (``ckpt/a`` beside a ``ckpt`` directory is a local path)."""
    if not isinstance(path, (str, os.PathLike)) or parse(os.fspath(path)) is None:
        return False
    text = os.fspath(path)
    return not os.path.exists(text) and not os.path.isdir(text.split("/", 1)[0])


def cache_dir() -> str:
    """huggingface_hub's cache as its environment names it now: ``HF_HUB_CACHE`` (or the older
    ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                              "huggingface")
    path = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.abspath(os.path.expandvars(os.path.expanduser(path)))


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids the network, as huggingface_hub reads it."""
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


def resolve(path: Any) -> Any:
    """The local path ``path`` stands for: itself unless it is a hub id (``is_hub_id``), else the cached
    snapshot directory or GGUF file (fetched first where the network allows). ``HubError`` naming the id
    and the cache directory when it cannot be had."""
    if not is_hub_id(path):
        return path
    return fetch(parse(os.fspath(path)))


def resolve_config(model_config, loaders) -> None:
    """A ``ModelConfig`` whose ``checkpoint``, or whose loader's ``path`` (its ``model_fn`` one of ``loaders``),
    is a hub id, changed in place to name the resolved local path, so that everything after it (the
    preflight's checks, the workers) sees a local checkpoint. One fetch per id."""
    resolved = {}

    def local(value):
        if is_hub_id(value):
            if value not in resolved:
                resolved[value] = resolve(value)
            return resolved[value]
        return value
    kwargs = model_config.model_kwargs
    if any(model_config.model_fn is f for f in loaders) and is_hub_id(kwargs.get("path")):
        model_config.model_kwargs = {**kwargs, "path": local(kwargs["path"])}
    model_config.checkpoint = local(model_config.checkpoint)


def fetch(ref: HubRef) -> str:
    """The cached snapshot directory, or GGUF file, of ``ref``: from the cache alone when ``offline()``,
    else through the hub (what the cache holds already is not fetched again)."""
    cache, local_only = cache_dir(), offline()
    if local_only:
        log.info("%s: looking in the Hugging Face cache %s (HF_HUB_OFFLINE is set: nothing is downloaded)", ref, cache)
    else:
        log.info("%s: fetching what the Hugging Face cache %s lacks from the hub", ref, cache)
    try:
        with _progress_bars(not local_only):
            if ref.filename is not None:
                path = _download_file(ref, cache, local_only)
            else:
                path = _download_snapshot(ref, cache, local_only)
    except Exception as exc:  # noqa: BLE001 - each of huggingface_hub's errors becomes one line naming the id
        raise HubError(_explain(ref, cache, local_only, exc)) from None
    if ref.filename is None:
        _check_snapshot(ref, path)
    log.info("%s: %s", ref, path)
    return path


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """huggingface_hub's progress bars on for a download (transformers turns them off whenever it loads a
    model in this process), unless ``HF_HUB_DISABLE_PROGRESS_BARS`` says otherwise; as they were after it."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    if not shown or (os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") or "").upper() in _TRUE \
            or not are_progress_bars_disabled():
        yield
        return
    enable_progress_bars()
    try:
        yield
    finally:
        disable_progress_bars()


def _download_file(ref: HubRef, cache: str, local_only: bool) -> str:
    from huggingface_hub import hf_hub_download
    return hf_hub_download(ref.repo_id, ref.filename, revision=ref.revision, cache_dir=cache,
                           local_files_only=local_only)


def _download_snapshot(ref: HubRef, cache: str, local_only: bool) -> str:
    from huggingface_hub import snapshot_download
    path = snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache, local_files_only=local_only,
                             ignore_patterns=list(NOT_FETCHED + PICKLED_WEIGHTS))
    if not local_only and not _files(path, ".safetensors"):
        log.info("%s: no safetensors weights: fetching its pytorch_model*.bin files", ref)
        path = snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache, local_files_only=False,
                                 ignore_patterns=list(NOT_FETCHED))
    return path


def _files(folder: str, suffix: str) -> List[str]:
    found = []
    for root, _dirs, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names if n.lower().endswith(suffix)]
    return sorted(found)


def _check_snapshot(ref: HubRef, path: str) -> None:
    """A snapshot without ``config.json`` is no transformers checkpoint: a GGUF repository's files are named
    one by one, so say which it holds."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    ggufs = _files(path, ".gguf")
    if ggufs:
        raise HubError(f"{ref}: its snapshot {path} has no config.json but GGUF files: name one, e.g. "
                       f"{ref}:{ggufs[0]} (it holds {', '.join(ggufs[:4])}{', ...' if len(ggufs) > 4 else ''})")
    raise HubError(f"{ref}: its snapshot {path} has no config.json: not a transformers checkpoint (a GGUF "
                   f"repository's file is named: {ref}:FILE.gguf)")


def _explain(ref: HubRef, cache: str, local_only: bool, exc: Exception) -> str:
    from huggingface_hub import errors
    first = (str(exc).strip().splitlines() or [""])[0]
    where = f"the Hugging Face cache {cache}"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        what = (f"the file {ref.filename!r} of {ref.repo_id}" if ref.filename else
                f"{ref.repo_id} at revision {ref.revision}" if ref.revision else ref.repo_id)
        command = " ".join(["hf download", ref.repo_id] + ([ref.filename] if ref.filename else []) +
                           ([f"--revision {ref.revision}"] if ref.revision else []))
        why = (f"HF_HUB_OFFLINE is set: nothing is downloaded; fetch it into that cache where the network is "
               f"({command}), or set HF_HUB_CACHE or HF_HOME to the cache that holds it" if local_only else
               f"the hub could not be reached: {first}")
        return f"{ref}: no such local path, and {what} is not in {where} ({why})"
    if isinstance(exc, errors.GatedRepoError):
        return f"{ref}: a gated repository: accept its terms on huggingface.co and log in (hf auth login) ({first})"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"{ref}: neither a local path nor a repository of the Hugging Face hub (or a private one: log in "
                f"with hf auth login); cache {cache}")
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{ref}: the repository {ref.repo_id} has no revision {ref.revision!r}; cache {cache}"
    if isinstance(exc, errors.EntryNotFoundError):
        return f"{ref}: the repository {ref.repo_id} has no file {ref.filename!r}; cache {cache}"
    return f"{ref}: cannot be fetched into {where}: {type(exc).__name__}: {first}"


__all__ = ["HubRef", "NOT_FETCHED", "PICKLED_WEIGHTS", "parse", "is_hub_id", "cache_dir", "offline", "resolve",
           "resolve_config", "fetch"]
