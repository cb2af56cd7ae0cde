"""A matmul of a few rows on a CPU that streams each weight once, built on first use with the system C compiler.

A decode step multiplies one row per sequence by every weight of the model: it is a read of the weights,
and its speed is the memory's. oneDNN's packed product (``cpu_linear``'s other kernel) read SmolLM2's
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

The C source below is compiled once per machine by ``cpu_kernels`` (GCC's vector extensions: no intrinsics,
so any target builds it). Before first use its result is compared with ``F.linear``; where there is no
compiler, the build fails, the check does or the kernel loses the timing, ``available()`` is False (one
WARNING says why) and ``cpu_linear`` keeps oneDNN or ``F.linear``: a CPU without it still serves. The kernel
is single-threaded: it is used where a worker computes on one intra-op thread (this machine's default).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import time
from typing import NamedTuple, Optional, Tuple

import torch

from . import cpu_kernels

log = logging.getLogger(__name__)

BLOCK = 16
"""Output features per weight block: one vector of 16 floats."""

MAX_ROWS = 64
"""The most activation rows computed here (the largest row count measured to win); more go to ``F.linear``."""

_SOURCE = r"""
#include <string.h>
#if defined(__AVX512F__)
/* 32 vector registers of 16 floats: a tile of up to 8 rows keeps its accumulators in registers */
typedef float v16 __attribute__((vector_size(64)));
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void st(float* p, v16 v) { memcpy(p, &v, 64); }

/* one block (16 output features): MT rows, K split over two accumulators per row */
#define ONE(MT)                                                                                      \
static void one_##MT(const float* x, const float* p, const float* b, float* y, long ldy, long K) {   \
  v16 a0[MT], a1[MT];                                                                                \
  for (int i = 0; i < MT; i++) a0[i] = a1[i] = (v16){0};                                             \
  long k = 0;                                                                                        \
  for (; k + 2 <= K; k += 2) {                                                                       \
    v16 w0 = ld(p + k * 16), w1 = ld(p + k * 16 + 16);                                               \
    _Pragma("GCC unroll 8") for (int i = 0; i < MT; i++) {                                           \
      a0[i] += x[i * K + k] * w0; a1[i] += x[i * K + k + 1] * w1;                                    \
    }                                                                                                \
  }                                                                                                  \
  for (; k < K; k++) {                                                                               \
    v16 w0 = ld(p + k * 16);                                                                         \
    for (int i = 0; i < MT; i++) a0[i] += x[i * K + k] * w0;                                         \
  }                                                                                                  \
  v16 bias = b ? ld(b) : (v16){0};                                                                   \
  for (int i = 0; i < MT; i++) st(y + i * ldy, a0[i] + a1[i] + bias);                                \
}

/* two blocks side by side (32 output features): MT rows, two products per activation load */
#define TWO(MT)                                                                                      \
static void two_##MT(const float* x, const float* p, const float* b, float* y, long ldy, long K) {   \
  v16 a0[MT], a1[MT];                                                                                \
  for (int i = 0; i < MT; i++) a0[i] = a1[i] = (v16){0};                                             \
  const float* q = p + K * 16;                                                                       \
  for (long k = 0; k < K; k++) {                                                                     \
    v16 w0 = ld(p + k * 16), w1 = ld(q + k * 16);                                                    \
    _Pragma("GCC unroll 8") for (int i = 0; i < MT; i++) {                                           \
      float xi = x[i * K + k]; a0[i] += xi * w0; a1[i] += xi * w1;                                   \
    }                                                                                                \
  }                                                                                                  \
  v16 b0 = b ? ld(b) : (v16){0}, b1 = b ? ld(b + 16) : (v16){0};                                     \
  for (int i = 0; i < MT; i++) { st(y + i * ldy, a0[i] + b0); st(y + i * ldy + 16, a1[i] + b1); }    \
}

ONE(1) ONE(2) ONE(3) ONE(4) ONE(5) ONE(6) ONE(7) ONE(8)
TWO(1) TWO(2) TWO(3) TWO(4) TWO(5) TWO(6) TWO(7) TWO(8)
typedef void (*tile)(const float*, const float*, const float*, float*, long, long);
static const tile ONES[9] = {0, one_1, one_2, one_3, one_4, one_5, one_6, one_7, one_8};
static const tile TWOS[9] = {0, two_1, two_2, two_3, two_4, two_5, two_6, two_7, two_8};

/* y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for M rows of x [M, K] (contiguous), w in blocks [NB, K, 16],
   b NULL or NB * 16 floats, y [M, ldy] with ldy >= NB * 16 */
void computron_block_matmul(const float* x, const float* w, const float* b, float* y,
                            long M, long K, long NB, long ldy) {
  long nb = 0;
  if (M > 1)
    for (; nb + 2 <= NB; nb += 2)
      for (long m = 0; m < M; m += 8) {
        long mt = M - m < 8 ? M - m : 8;
        TWOS[mt](x + m * K, w + nb * K * 16, b ? b + nb * 16 : 0, y + m * ldy + nb * 16, ldy, K);
      }
  for (; nb < NB; nb++)
    for (long m = 0; m < M; m += 8) {
      long mt = M - m < 8 ? M - m : 8;
      ONES[mt](x + m * K, w + nb * K * 16, b ? b + nb * 16 : 0, y + m * ldy + nb * 16, ldy, K);
    }
}
#else
/* 16 registers of 8 floats (AVX2; NEON has 32 of 4): a block is two vectors, a tile at most 6 rows
   (12 accumulators, 2 weights, 1 broadcast); the rows past a tile read the block again from L2 */
typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld(const float* p) { v8 v; memcpy(&v, p, 32); return v; }
static inline void st(float* p, v8 v) { memcpy(p, &v, 32); }
#define MAXT 6

#define TILE(MT)                                                                                     \
static void tile_##MT(const float* x, const float* p, const float* b, float* y, long ldy, long K) {  \
  v8 lo[MT], hi[MT];                                                                                 \
  for (int i = 0; i < MT; i++) lo[i] = hi[i] = (v8){0};                                              \
  for (long k = 0; k < K; k++) {                                                                     \
    v8 w0 = ld(p + k * 16), w1 = ld(p + k * 16 + 8);                                                 \
    _Pragma("GCC unroll 8") for (int i = 0; i < MT; i++) {                                           \
      float xi = x[i * K + k]; lo[i] += xi * w0; hi[i] += xi * w1;                                   \
    }                                                                                                \
  }                                                                                                  \
  v8 b0 = b ? ld(b) : (v8){0}, b1 = b ? ld(b + 8) : (v8){0};                                         \
  for (int i = 0; i < MT; i++) { st(y + i * ldy, lo[i] + b0); st(y + i * ldy + 8, hi[i] + b1); }     \
}

/* one row: K split over two pairs of accumulators, so the adds do not wait on each other */
static void row_1(const float* x, const float* p, const float* b, float* y, long K) {
  v8 a0 = {0}, a1 = {0}, c0 = {0}, c1 = {0};
  long k = 0;
  for (; k + 2 <= K; k += 2) {
    a0 += x[k] * ld(p + k * 16); a1 += x[k] * ld(p + k * 16 + 8);
    c0 += x[k + 1] * ld(p + k * 16 + 16); c1 += x[k + 1] * ld(p + k * 16 + 24);
  }
  for (; k < K; k++) { a0 += x[k] * ld(p + k * 16); a1 += x[k] * ld(p + k * 16 + 8); }
  v8 b0 = b ? ld(b) : (v8){0}, b1 = b ? ld(b + 8) : (v8){0};
  st(y, a0 + c0 + b0); st(y + 8, a1 + c1 + b1);
}

TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
typedef void (*tile)(const float*, const float*, const float*, float*, long, long);
static const tile TILES[MAXT + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

void computron_block_matmul(const float* x, const float* w, const float* b, float* y,
                            long M, long K, long NB, long ldy) {
  for (long nb = 0; nb < NB; nb++) {
    const float* p = w + nb * K * 16;
    const float* bb = b ? b + nb * 16 : 0;
    if (M == 1) { row_1(x, p, bb, y + nb * 16, K); continue; }
    for (long m = 0; m < M; m += MAXT) {
      long mt = M - m < MAXT ? M - m : MAXT;
      TILES[mt](x + m * K, p, bb, y + m * ldy + nb * 16, ldy, K);
    }
  }
}
#endif
"""


@functools.lru_cache(maxsize=None)
def _kernel():
    """The compiled function, checked against ``F.linear``, or None (with one WARNING saying why)."""
    try:
        fn = cpu_kernels.load("block_matmul", _SOURCE, "computron_block_matmul",
                              [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4)
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
    path = cpu_kernels.build("block_matmul", _SOURCE) + ".timed"
    try:
        with open(path) as f:
            verdict = f.read().strip()
    except OSError:
        ours, theirs = time_against_torch(_kernel())
        verdict = (f"{'wins' if ours < theirs else 'loses'}: {ours * 1e3:.2f} ms against F.linear's "
                   f"{theirs * 1e3:.2f} ms ({' and '.join(map(str, TRIAL_ROWS))} rows by a "
                   f"{TRIAL_WEIGHT[0]}x{TRIAL_WEIGHT[1]} weight, one thread)")
        try:
            cpu_kernels.write_beside(path, verdict)
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
        fn(x.data_ptr(), blocked.data_ptr(), bias.data_ptr() if fused else None, y.data_ptr(), rows, k, nb, nb * BLOCK)
    if not whole:
        y = y[:, :out_features].contiguous()
    return y if bias is None or fused else y.add_(bias)


class Call(NamedTuple):
    """The kernel's call on one blocked weight, what ``cpu_linear.FewRowLinear`` runs per product in eager
    steps (gradients off, not compiling): everything ``matmul`` derives at each call, derived once. ``key``
    names the weight it was blocked from (``cpu_linear.packed_weight``'s); a call on anything else returns
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
        self.fn(x.data_ptr(), self.pointer, None if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                self.k, self.nb, width)
        return y.view(*x.shape[:-1], width)


def matmul(x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor], out_features: int):
    """``x @ W^T + bias`` for float32 ``x`` of any leading shape on a CPU, ``W`` as ``block`` left it;
    ``available()`` must be True."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return _run(_kernel(), flat, blocked, bias, out_features).view(*x.shape[:-1], out_features)


__all__ = ["available", "built", "time_against_torch", "block", "matmul", "Call", "BLOCK", "MAX_ROWS"]
