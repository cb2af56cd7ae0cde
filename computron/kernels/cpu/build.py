"""Owner: building and loading the C kernels of CPUs (``gemm``, ``attention``; their sources: the ``.c`` files here).

Each kernel's C source is compiled once per machine with the system C compiler (``-O3 -march=native``) into
``$COMPUTRON_CACHE_DIR/kernels`` (default ``~/.cache/computron/kernels``), named by a hash of the source, the
compiler, its flags and the processor (a cache shared between hosts never hands one a library built for
another), and loaded with ``ctypes``, which lets go of the GIL during a call. Processes building at once each
write a file of their own and rename it into place: one wins whole. Failures raise; the kernels' owners turn
them into ``available() == False`` and their callers keep torch's operators.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
CACHE_ENV = "COMPUTRON_CACHE_DIR"


def _machine_key() -> str:
    """What ``-march=native`` compiles for: the processor's name and flags."""
    info = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(sorted({ln for ln in f if ln.startswith(("flags", "model name", "Features"))}))
    except OSError:
        pass
    return platform.machine() + info


def kernel_dir() -> str:
    base = os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "computron")
    return os.path.join(os.path.expanduser(base), "kernels")


def build(name: str, source: str) -> str:
    """The shared library of ``source`` (``name_<hash>.so``), compiled first where it is not cached yet."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256("\0".join((source, cc, *FLAGS, _machine_key())).encode()).hexdigest()[:16]
    folder = kernel_dir()
    path = os.path.join(folder, f"{name}_{key}.so")
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")  # same folder: the rename below is atomic
    os.close(fd)
    src = tmp[:-3] + ".c"
    try:
        with open(src, "w") as f:
            f.write(source)
        proc = subprocess.run([cc, *FLAGS, src, "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"{cc} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        os.replace(tmp, path)
    finally:
        for leftover in (src, tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)
    log.info("built the CPU kernel %s: %s", name, path)
    return path


def write_beside(path: str, text: str) -> None:
    """Write ``text`` to ``path`` in the cache whole (a file of its own renamed into place), as a build is."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(name: str, source: str, symbol: str, argtypes) -> ctypes._CFuncPtr:
    """``symbol`` of ``source``'s library (built first where needed), typed ``argtypes``, returning nothing."""
    fn = getattr(ctypes.CDLL(build(name, source)), symbol)
    fn.restype = None
    fn.argtypes = list(argtypes)
    return fn


__all__ = ["build", "load", "write_beside", "kernel_dir", "CACHE_ENV", "FLAGS"]
