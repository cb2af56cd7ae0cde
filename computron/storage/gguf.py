"""GGUF files as checkpoints: a ``.gguf`` file served at its own bytes, its metadata written once as a directory.

Wherever a checkpoint directory goes (``ModelConfig.checkpoint``, ``load_causal_lm``'s ``path``, ``computron
serve ID=FILE.gguf``, a YAML model's ``path``, a ``--model-repository`` subdirectory holding one ``.gguf``), a
``.gguf`` file may go instead. The master checks it (``inspect``: header, tensor table, architecture, block
types) and writes, once, its config (in ``dtype``: what its unquantized tensors are served in, float32 unless
the model says otherwise), tokenizer (chat template included) and generation config, as transformers reads
them from the file, into a small directory with ``gguf_source.json`` naming the file (``convert``); no
weights. The workers build the model from that directory and read the file's tensors themselves, quantized
blocks as they are (``gguf_native``).

The cache: ``$COMPUTRON_CACHE_DIR/gguf`` (default ``~/.cache/computron/gguf``), one directory per file and
dtype, named ``STEM-DTYPE-KEY`` where KEY hashes the file's absolute path (links resolved), size, modification
time, the dtype and ``LAYOUT``: a file changed in place is read again; deleting the cache is always safe. A
directory is written into a temporary one next to its target and renamed into place (``os.replace``), so a
write that was killed leaves nothing half-made (its temporary directory is removed by the next one); a lock file
(``fcntl.flock``) makes a second process writing the same file's directory wait for the first and use its result.

Every problem is a ``GGUFError``, one line naming the file, raised before anything is written: not a GGUF file, a
truncated one, an architecture transformers cannot read, a block type Computron does not serve, a cache directory
that cannot be written. A file whose architecture's tensors transformers reshapes (Gemma 2/3, GPT-2, Bloom, ...:
``gguf_native.check_architecture``) is converted once into a float checkpoint instead, as before. torch,
transformers and gguf are imported only when a file is inspected or its metadata written.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

from ..errors import GGUFError
from ..loading import DTYPES

log = logging.getLogger("computron.gguf")

SUFFIX = ".gguf"
MAGIC = b"GGUF"
CACHE_ENV = "COMPUTRON_CACHE_DIR"
LAYOUT = "metadata-only"
"""What a cache directory holds (in its key): a float32 conversion of an older Computron is never taken for one."""
DEFAULT_DTYPE = "float32"
"""The dtype a GGUF file is served in when the model names none (what transformers dequantizes to)."""

_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
            "t5encoder": "t5"}
"""llama.cpp's architecture names that transformers reads under another name."""


def is_gguf(path) -> bool:
    """Whether ``path`` names a ``.gguf`` file (by its name: whether it is one is ``check_header``'s job)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(SUFFIX)


def cache_root() -> str:
    """``$COMPUTRON_CACHE_DIR/gguf``, default ``~/.cache/computron/gguf``."""
    base = os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "computron")
    return os.path.join(os.path.abspath(os.path.expanduser(base)), "gguf")


def _dtype(dtype: Optional[str]) -> str:
    if dtype is None:
        return DEFAULT_DTYPE
    if dtype not in DTYPES:
        raise GGUFError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)} or None")
    return dtype


def cache_dir(path, dtype: Optional[str] = None) -> str:
    """The directory ``path``'s conversion to ``dtype`` has (or will have) in the cache: keyed by the file's
    absolute path (symbolic links resolved), size and modification time, and the dtype."""
    full = os.path.realpath(os.path.expanduser(os.fspath(path)))
    st = os.stat(full)
    dtype = _dtype(dtype)
    key = hashlib.sha256(f"{full}\0{st.st_size}\0{st.st_mtime_ns}\0{dtype}\0{LAYOUT}".encode()).hexdigest()[:16]
    stem = os.path.basename(full)[:-len(SUFFIX)] if is_gguf(full) else os.path.basename(full)
    return os.path.join(cache_root(), f"{stem[:80]}-{dtype}-{key}")


def check_header(path) -> str:
    """The absolute path of ``path`` when it is a regular file that begins with the GGUF magic (reads 4
    bytes); ``GGUFError`` otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise GGUFError(f"{path!r}: expected the path of a .gguf file")
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(full):
        raise GGUFError(f"{full}: no such GGUF file")
    if not os.path.isfile(full):
        raise GGUFError(f"{full}: not a file (a .gguf path must name a GGUF file)")
    try:
        with open(full, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as exc:
        raise GGUFError(f"{full}: cannot read it: {exc.strerror or exc}") from None
    if head != MAGIC:
        what = "an empty file" if not head else f"it begins with {head!r}"
        raise GGUFError(f"{full}: not a GGUF file ({what}, not the magic {MAGIC!r})")
    return full


@dataclass(frozen=True)
class GGUFInfo:
    path: str
    architecture: str
    """``general.architecture``: llama.cpp's name (``llama``, ``qwen2``, ...)."""
    tensors: int
    types: Tuple[str, ...]
    """The tensor types it holds (``Q4_1``, ``F32``, ...)."""
    size: int
    float_why: str = ""
    """Why its blocks cannot be served as they are (its architecture's tensors need transformers' reshaping):
    then it is converted to a float checkpoint once instead; empty when they can."""


def inspect(path) -> GGUFInfo:
    """``check_header``, then the file's header and tensor table parsed (``gguf_native.layout``: a truncated
    file fails here), its architecture checked against the ones transformers reads and Computron serves, and
    every tensor's block type against the ones it serves. ``GGUFError`` for the first problem."""
    full = check_header(path)
    size = os.path.getsize(full)
    try:
        import gguf  # noqa: F401 - the block types' names and sizes
    except ImportError:
        raise GGUFError(f"{full}: reading GGUF files needs the gguf package: pip install 'computron[gguf]'") from None
    from .gguf_native import check_architecture, check_types, layout
    try:
        found, arch = layout(full)
    except GGUFError as exc:
        raise GGUFError(f"{full}: truncated or corrupt GGUF file ({size} bytes): "
                        f"{str(exc).split('GGUF header: ', 1)[-1]}") from None
    end = max((t.begin + t.rows * t.row_bytes for t in found.values()), default=0)
    if end > size:
        raise GGUFError(f"{full}: truncated GGUF file: its tensors end at byte {end}, the file has {size}")
    if not isinstance(arch, str) or not arch:
        raise GGUFError(f"{full}: no general.architecture field: not a model GGUF file")
    _check_architecture(full, arch)
    check_types(full, found)
    try:
        check_architecture(full, arch)
        float_why = ""
    except GGUFError as exc:
        float_why = str(exc)
    return GGUFInfo(full, arch, len(found), tuple(sorted({t.type_name for t in found.values()})), size, float_why)


def _check_architecture(full: str, arch: str) -> None:
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    readable = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    if _RENAMED.get(arch, arch) not in readable:
        raise GGUFError(f"{full}: GGUF architecture {arch!r} is not one transformers {transformers.__version__} "
                        f"can read (it reads: {', '.join(sorted(readable))})")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "(version unknown)"


def convert(path, dtype: Optional[str] = None) -> str:
    """The metadata directory of the GGUF file ``path`` in ``dtype`` (None: float32): the cache's when it is
    there (a ``stat`` and a look), else written now after ``inspect`` (transformers parses the file's metadata
    for the config and again for the tokenizer: seconds). ``GGUFError`` for a bad file or an unwritable cache."""
    full = check_header(path)
    dtype = _dtype(dtype)
    target = cache_dir(full, dtype)
    if os.path.isdir(target):
        log.info("%s: using its %s metadata directory %s (cached)", full, dtype, target)
        return target
    root = _writable(full, os.path.dirname(target))
    info = inspect(full)  # seconds; a bad file fails here, before any log line (the error is its one line)
    log.info("writing the config and tokenizer of %s (%.1f MB, %s, %s) to %s, once (its tensors are served "
             "as the file holds them)", full, info.size / 1e6, info.architecture, "/".join(info.types), target)
    with _locked(target + ".lock", full):
        if os.path.isdir(target):  # another process converted it while this one waited
            log.info("%s: converted by another process: %s", full, target)
            return target
        for stale in glob.glob(os.path.join(glob.escape(root), f".{glob.escape(os.path.basename(target))}.tmp-*")):
            log.info("removing %s, left by a conversion that did not finish", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=root)
        try:
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep the checkpoint from other users of the cache
            if info.float_why:
                log.warning("%s; converting it to a %s checkpoint instead, once (its blocks are not kept)",
                            info.float_why, dtype)
                _convert_to_float(info, dtype, tmp, target)
            else:
                _convert(info, dtype, tmp, target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _writable(full: str, root: str) -> str:
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise GGUFError(f"{full}: cannot write its converted checkpoint to the cache directory {root} "
                        f"({exc.strerror or exc}); set {CACHE_ENV} to a writable directory") from None
    return root


@contextlib.contextmanager
def _locked(lock_path: str, full: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path`` for the block (released when its descriptor closes, also
    when the process dies)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process is converting it; waiting for it", full)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _quiet(hf_gguf) -> Iterator[None]:
    """No progress bars: transformers' own (its logging setting) and the GGUF reader's ``tqdm``."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    bar = getattr(hf_gguf, "tqdm", None)
    hf_gguf.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if bar is not None:
            hf_gguf.tqdm = bar


def _convert(info: GGUFInfo, dtype: str, out: str, target: str) -> None:
    """Write ``info.path``'s config (in ``dtype``), tokenizer (chat template included) and generation config
    into ``out``, read by transformers from the file's metadata, and ``gguf_source.json`` naming the file:
    no weights (the workers read those from the file: ``gguf_native``)."""
    import torch
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    t0 = time.perf_counter()
    folder, name = os.path.split(info.path)
    try:
        with _quiet(hf_gguf):
            config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
            config.dtype = getattr(torch, dtype)
            if not getattr(config, "architectures", None):  # what model.save_pretrained would have written
                from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            config.save_pretrained(out)
            GenerationConfig.from_model_config(config).save_pretrained(out)
            tokenizer.save_pretrained(out)
    except Exception as exc:  # noqa: BLE001 - one line naming the file, whatever transformers raised
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise GGUFError(f"{info.path}: transformers cannot read its config and tokenizer: {type(exc).__name__}: "
                        f"{first}") from None
    with open(os.path.join(out, "gguf_source.json"), "w") as f:
        json.dump({"gguf": info.path, "size": info.size, "mtime_ns": os.stat(info.path).st_mtime_ns,
                   "dtype": dtype, "architecture": info.architecture, "types": list(info.types),
                   "seconds": round(time.perf_counter() - t0, 1)}, f, indent=1)
    nbytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    log.info("converted the metadata of %s in %.1f s (%.1f MB in %s); its weights stay in the file",
             name, time.perf_counter() - t0, nbytes / 1e6, target)



def _convert_to_float(info: GGUFInfo, dtype: str, out: str, target: str) -> None:
    """Read ``info.path`` with transformers (every tensor dequantized to ``dtype``, reshaped as its architecture
    needs) and save model, tokenizer and generation config into ``out`` as a safetensors checkpoint: served
    from then on like any other (no ``gguf_native.SOURCE_FILE`` in it)."""
    import torch
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.perf_counter()
    folder, name = os.path.split(info.path)
    try:
        with _quiet(hf_gguf):
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype),
                                                         local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            model.hf_quantizer = None  # plain tensors now: saved and loaded as such
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            # save_pretrained writes only on torch.distributed's rank 0, and a running engine's master is in a group
            model.should_save_on_this_rank = lambda *args, **kwargs: True
            model.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
    except Exception as exc:  # noqa: BLE001 - one line naming the file, whatever transformers raised
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise GGUFError(f"{info.path}: transformers cannot convert it: {type(exc).__name__}: {first}") from None
    if not any(f.endswith(".safetensors") for f in os.listdir(out)):
        raise GGUFError(f"{info.path}: transformers wrote no safetensors weights when saving its conversion")
    del model
    log.info("converted %s in %.1f s to a %s checkpoint in %s", name, time.perf_counter() - t0, dtype, target)


__all__ = ["SUFFIX", "CACHE_ENV", "DEFAULT_DTYPE", "GGUFInfo", "is_gguf", "cache_root", "cache_dir", "check_header",
           "inspect", "convert"]
