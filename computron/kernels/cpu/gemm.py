"""A matmul of a few rows on a CPU that streams each weight once, built on first use with the system C compiler.

A decode step multiplies one row per sequence by every weight of the model: it is a read of the weights,
and its speed is the memory's. oneDNN's packed product (``linear``'s other kernel) read SmolLM2's
weights at 12-14 GB/s on one core of this machine where a plain sum over them reads 22-24 GB/s. This kernel
keeps a weight in blocks of 16 output features, ``[N / 16, K, 16]`` (each block's 16 weights of one input
feature side by side), and, for a tile of activation rows, adds ``x[m, k] * block[k]`` into one 16-wide
accumulator per row and block: the weight is read once, in order, and nothing is summed across lanes.
The tiles fit the processor's vector registers: with AVX-512 (32 registers of 16 floats) up to 8 rows and two
blocks together (twice the products per activation load; a single row splits ``K`` over two accumulators); else
(AVX2: 16 registers of 8 floats) a block is two vectors and a tile up to 6 rows. A decode step of SmolLM2
in process (``benchmarks/decode_step.py --worker-linears --batch 1|8 --steps 16``, one thread) took, on the
machine of 2026-12-05 (then only the 16-float tiles), 34 ms at batch 1 and 49-53 ms at batch 8 on these blocks
against 55 and 77 ms on oneDNN's packs; on an AVX2 EPYC (2026-12-07) 50-52 and 70-88 ms against F.linear's
53-58 and 105-110 ms, where the 16-float tiles, spilling their registers, had taken 80-90 ms at batch 1
(``benchmarks/cpu_kernels.py``: one product of 8 rows by the LM head took them 8.6x F.linear's time, now
0.44x). So a build is timed against ``F.linear`` once (``_wins``) and used only where it is faster.

The C source (``gemm.c``) is compiled once per machine by ``build`` (GCC's vector extensions:
no intrinsics, so any target builds it). Before first use its result is compared with ``F.linear``; where there is no
compiler, the build fails, the check does or the kernel loses the timing, ``available()`` is False (one
WARNING says why) and ``linear`` keeps oneDNN or ``F.linear``: a CPU without it still serves. The kernel
is used where a worker computes on one intra-op thread (this machine's default); ``lend_cores`` gives it
helper threads of idle priority on the cores no worker holds (``EngineConfig.cpu_helpers``), which take
chunks of a product's blocks while their core is free (their protocol: ``gemm.c``). Two cores of
this machine's memory read ~30 GB/s together where one reads ~20, so a product of one row gets ~1.3-1.5x
faster with one helper and one of 8-9 rows, more bound by the arithmetic, ~1.4-1.9x; the results are the
same bit for bit.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import time
from importlib import resources
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import build

log = logging.getLogger(__name__)

BLOCK = 16
"""Output features per weight block: one vector of 16 floats."""

MAX_ROWS = 64
"""The most activation rows computed here (the largest row count measured to win); more go to ``F.linear``."""

_SOURCE = resources.files(__package__).joinpath("gemm.c").read_text()
"""The kernel's C source, shipped beside this module (``gemm.c``)."""


@functools.lru_cache(maxsize=None)
def _kernel():
    """The compiled function, checked against ``F.linear``, or None (with one WARNING saying why)."""
    try:
        fn = build.load("block_matmul", _SOURCE, "computron_block_matmul",
                              [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4)
        fn.restype = ctypes.c_long  # 0, or the job a helper thread may still read (``_keep``)
        _self_check(fn)
        return fn
    except Exception as exc:  # noqa: BLE001 - any failure means the other kernels, never an error
        log.warning("the CPU block matmul kernel is not used (%s: %s); Linears run on oneDNN or F.linear",
                    type(exc).__name__, exc)
        return None


def _self_check(fn) -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, out_f, in_f in ((1, 48, 37), (11, 80, 64), (3, 16, 5)):
        x, w, b = (torch.randn(*s, generator=gen) for s in ((rows, in_f), (out_f, in_f), (out_f,)))
        got = _run(fn, x, block(w), b, out_f)
        want = torch.nn.functional.linear(x, w, b)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"its result differs from F.linear by {(got - want).abs().max().item():.3g}")


TRIAL_WEIGHT = (12288, 1024)
"""The weight a build is timed on against ``F.linear``: 48 MB, past the caches as a model's weights are."""

TRIAL_ROWS = (1, 8)


def time_against_torch(fn, shape=TRIAL_WEIGHT, rows=TRIAL_ROWS, repeats: int = 3) -> Tuple[float, float]:
    """``(this kernel's, F.linear's)`` seconds for one product of each of ``rows`` rows by a random weight of
    ``shape``, the best of ``repeats`` alternated runs each, both on one intra-op thread (where it is used)."""
    w = torch.randn(*shape)
    blocked = block(w)
    xs = [torch.randn(m, shape[1]) for m in rows]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = [float("inf"), float("inf")]
        for _ in range(repeats + 1):  # the first round warms both up
            for i, run in enumerate((lambda x: _run(fn, x, blocked, None, shape[0]),
                                     lambda x: torch.nn.functional.linear(x, w))):
                t0 = time.perf_counter()
                for x in xs:
                    run(x)
                best[i] = min(best[i], time.perf_counter() - t0)
        return best[0], best[1]
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _wins() -> bool:
    """Whether the built kernel is faster than ``F.linear`` on this machine: timed once per build
    (``time_against_torch``), the verdict kept beside the library. On one machine its 16-float tiles took 0.6x
    oneDNN's time, on another (AVX2) they spilled their registers and took 8-10x ``F.linear``'s until they
    got tiles of their own: a kernel that loses is never used."""
    path = build.build("block_matmul", _SOURCE) + ".timed"
    try:
        with open(path) as f:
            verdict = f.read().strip()
    except OSError:
        ours, theirs = time_against_torch(_kernel())
        verdict = (f"{'wins' if ours < theirs else 'loses'}: {ours * 1e3:.2f} ms against F.linear's "
                   f"{theirs * 1e3:.2f} ms ({' and '.join(map(str, TRIAL_ROWS))} rows by a "
                   f"{TRIAL_WEIGHT[0]}x{TRIAL_WEIGHT[1]} weight, one thread)")
        try:
            build.write_beside(path, verdict)
        except OSError as exc:  # a cache it cannot write to: timed again by the next process
            log.info("the CPU block matmul kernel's timing is not kept (%s)", exc)
    (log.info if verdict.startswith("wins") else log.warning)(
        "the CPU block matmul kernel %s%s", verdict, "" if verdict.startswith("wins") else
        ": Linears run on oneDNN or F.linear")
    return verdict.startswith("wins")


def built() -> bool:
    """Whether the kernel is built and right on this machine (built on the first call), winning or not."""
    return _kernel() is not None


def available() -> bool:
    """Whether the kernel is built, right and faster than ``F.linear`` on this machine (``_wins``)."""
    return built() and _wins()


def block(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as blocks ``[ceil(N / 16), K, 16]``, the last one padded with zeros."""
    n, k = weight.shape
    nb = -(-n // BLOCK)
    w = weight.detach().float()
    if nb * BLOCK != n:
        w = torch.cat([w, w.new_zeros(nb * BLOCK - n, k)])
    return w.view(nb, BLOCK, k).transpose(1, 2).contiguous()


def _run(fn, x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor], out_features: int):
    rows, k = x.shape
    nb = blocked.shape[0]
    whole = nb * BLOCK == out_features  # else the kernel's bias would be read past its end: added after
    fused = bias is not None and whole and bias.dtype == torch.float32 and bias.is_contiguous()
    y = torch.empty(rows, nb * BLOCK, dtype=torch.float32)
    if rows:
        job = fn(x.data_ptr(), blocked.data_ptr(), bias.data_ptr() if fused else None, y.data_ptr(), rows, k, nb,
                 nb * BLOCK)
        if job or _HELD:
            _keep(job, x, blocked, bias)
    if not whole:
        y = y[:, :out_features].contiguous()
    return y if bias is None or fused else y.add_(bias)


class Call(NamedTuple):
    """The kernel's call on one blocked weight, what ``linear.FewRowLinear`` runs per product in eager
    steps (gradients off, not compiling): everything ``matmul`` derives at each call, derived once. ``key``
    names the weight it was blocked from (``linear.packed_weight``'s); a call on anything else returns
    None (the caller takes the long way, which packs again or falls back)."""
    key: tuple
    fn: object
    blocked: torch.Tensor
    pointer: int
    k: int
    nb: int

    @staticmethod
    def of(key: tuple, blocked: torch.Tensor, out_features: int) -> Optional["Call"]:
        """The call on ``blocked``, or None where the kernel or its fast case does not apply (padded
        blocks: ``out_features`` not a multiple of ``BLOCK``)."""
        nb = blocked.shape[0]
        fn = _kernel()
        if fn is None or nb * BLOCK != out_features:
            return None
        return Call(key, fn, blocked, blocked.data_ptr(), blocked.shape[1], nb)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor], key: tuple) -> Optional[torch.Tensor]:
        if key != self.key or torch.is_grad_enabled() or x.dtype != torch.float32 or not x.is_cpu \
                or x.dim() < 2 or x.shape[-1] != self.k or not x.is_contiguous():
            return None
        rows = x.numel() // self.k
        if not 0 < rows <= MAX_ROWS:
            return None
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return None
        width = self.nb * BLOCK
        y = torch.empty(rows, width, dtype=torch.float32)
        job = self.fn(x.data_ptr(), self.pointer, None if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                      self.k, self.nb, width)
        if job or _HELD:
            _keep(job, x, self.blocked, bias)
        return y.view(*x.shape[:-1], width)


_HELD: List[Tuple[int, tuple]] = []
"""``(job, tensors)`` a helper thread may still be reading: the product took a chunk back from it (the
helpers' protocol: ``gemm.c``). Kept alive until no helper is inside that job."""


def _keep(job: int, *tensors) -> None:
    if job:
        _HELD.append((job, tensors))
    inside = _library().computron_gemm_inside
    _HELD[:] = [held for held in _HELD if inside(held[0])]


@functools.lru_cache(maxsize=None)
def _library():
    lib = ctypes.CDLL(build.build("block_matmul", _SOURCE))
    lib.computron_gemm_lend.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.computron_gemm_lend.restype = ctypes.c_int
    lib.computron_gemm_inside.argtypes = [ctypes.c_long]
    lib.computron_gemm_inside.restype = ctypes.c_int
    lib.computron_gemm_slow_helpers.argtypes = [ctypes.c_long]
    lib.computron_gemm_slow_helpers.restype = None
    return lib


def lend_cores(helpers: int, cores: Sequence[int] = ()) -> int:
    """Start ``helpers`` threads that share this process's products of at least a few blocks, at idle priority
    on ``cores`` (anywhere where empty): once per process, where the kernel is used (``available()``, timed
    before any helper runs); returns how many run (0 where the kernel or the platform, not Linux, has none)."""
    if helpers <= 0 or not available():
        return 0
    chosen = (ctypes.c_int * len(cores))(*cores)
    started = _library().computron_gemm_lend(helpers, chosen, len(cores))
    log.info("the CPU block matmul shares its products with %d helper thread(s) on cores %s", started,
             list(cores) or "any")
    return started


def matmul(x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor], out_features: int):
    """``x @ W^T + bias`` for float32 ``x`` of any leading shape on a CPU, ``W`` as ``block`` left it;
    ``available()`` must be True."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return _run(_kernel(), flat, blocked, bias, out_features).view(*x.shape[:-1], out_features)


__all__ = ["available", "built", "lend_cores", "time_against_torch", "block", "matmul", "Call", "BLOCK", "MAX_ROWS"]
