"""Owner: decode attention straight from the paged KV pool on a CPU (a C kernel, built on first use).

A decode step's attention, through the model's own SDPA, first gathers every row's keys and values out of
the pool into a padded batch (``index_select``: all of them copied, every layer, every step), then, for a
model with fewer KV heads than query heads, either repeats them per query head or regroups the queries, and
runs ``scaled_dot_product_attention`` with an additive mask over the padding. For the few tokens a decode row
attends on this machine, that is mostly copies and operator overhead. This kernel reads each row's keys and
values in place, by its block table's slot indices, once per KV head for all the query heads that share it,
with a softmax over the row's own length (the last ``window`` tokens for a sliding-window layer): nothing is
gathered, padded or masked. Its vectors have the processor's width: on an AVX2 EPYC (2026-12-07) the calls of a
decode step's 30 layers for 8 rows of SmolLM2's shape (9 query heads on 3 KV heads of 64) over 48 keys took
10.8 ms with vectors of 16 floats, 3.2 ms with 8, against 8.3-8.7 ms gathered for SDPA
(``benchmarks/cpu_kernels.py``); on an AVX-512 EPYC the same calls took 2.62 ms, and 2.33 ms once a dot's
lanes were summed by halves (over 96 keys 5.01 and 4.45 ms).

It is single-threaded (used where a worker computes on one intra-op thread, as ``cpu_gemm`` is), float32,
and checked against SDPA before first use; where there is no compiler, the build fails or the check does,
``available()`` is False (one WARNING says why) and the pool gathers for the model's SDPA as before. The
hook into the model's attention is ``kv_pool``'s (``direct_fits``); a compiled decode step calls the kernel
as the opaque operator ``computron::paged_decode`` (``paged_decode``).
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from . import cpu_kernels

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>
/* a vector of the processor's width: 16 floats with AVX-512, else 8 (AVX2; wider ones emulated there took
   3.3x as long) */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vec __attribute__((vector_size(VW * 4)));
static inline vec ld(const float* p) { vec v; memcpy(&v, p, VW * 4); return v; }
static inline void st(float* p, vec v) { memcpy(p, &v, VW * 4); }

/* the sum of a vector's lanes by halves (a tree: a chain of 15 scalar adds was most of a dot's time) */
typedef float v4 __attribute__((vector_size(16)));
typedef float v8h __attribute__((vector_size(32)));
static inline float hsum(vec v) {
  v8h s8;
#if VW == 16
  v8h a, b;
  memcpy(&a, &v, 32); memcpy(&b, (char*)&v + 32, 32);
  s8 = a + b;
#else
  s8 = v;
#endif
  v4 c, d;
  memcpy(&c, &s8, 16); memcpy(&d, (char*)&s8 + 16, 16);
  v4 s4 = c + d;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static float dot(const float* a, const float* b, long D) {
  vec acc = (vec){0};
  long d = 0;
  for (; d + VW <= D; d += VW) acc += ld(a + d) * ld(b + d);
  float s = hsum(acc);
  for (; d < D; d++) s += a[d] * b[d];
  return s;
}

static void axpy(float* y, float w, const float* x, long D) {
  long d = 0;
  for (; d + VW <= D; d += VW) st(y + d, ld(y + d) + w * ld(x + d));
  for (; d < D; d++) y[d] += w * x[d];
}

/* out[b, h] = softmax_t(scale * q[b, h] . K[g, s_t]) . V[g, s_t], s_t = slots[b, t], t from start to
   lengths[b] - 1 (start = lengths[b] - window for window > 0), g = h / (H / KVH). q and out [B, H, D],
   the pools [KVH, S, D], slots [B, W]. Returns 0, or -1 where its scratch could not be allocated. */
int computron_paged_decode(const float* q, const float* kp, const float* vp, const long* slots,
                           const long* lengths, float* out, long B, long H, long KVH, long D, long S,
                           long W, float scale, long window) {
  long G = H / KVH;
  float* sc = malloc(sizeof(float) * G * (W > 0 ? W : 1));
  if (!sc) return -1;
  float mx[G], inv[G];
  for (long b = 0; b < B; b++) {
    long len = lengths[b], start = window > 0 && len > window ? len - window : 0;
    const long* sl = slots + b * W;
    for (long g = 0; g < KVH; g++) {
      const float* K = kp + g * S * D;
      const float* V = vp + g * S * D;
      const float* qg = q + (b * H + g * G) * D;
      float* og = out + (b * H + g * G) * D;
      for (long i = 0; i < G; i++) mx[i] = -INFINITY;
      for (long t = start; t < len; t++) {
        const float* k = K + sl[t] * D;
        for (long i = 0; i < G; i++) {
          float s = scale * dot(qg + i * D, k, D);
          sc[i * W + t] = s;
          if (s > mx[i]) mx[i] = s;
        }
      }
      for (long i = 0; i < G; i++) {
        float total = 0;
        for (long t = start; t < len; t++) {
          float e = expf(sc[i * W + t] - mx[i]);
          sc[i * W + t] = e;
          total += e;
        }
        inv[i] = total > 0 ? 1.0f / total : 0.0f;
        memset(og + i * D, 0, sizeof(float) * D);
      }
      for (long t = start; t < len; t++) {
        const float* v = V + sl[t] * D;
        for (long i = 0; i < G; i++) axpy(og + i * D, sc[i * W + t] * inv[i], v, D);
      }
    }
  }
  free(sc);
  return 0;
}
"""

_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 6 + [ctypes.c_float, ctypes.c_long]


@functools.lru_cache(maxsize=None)
def _kernel():
    """The compiled function, checked against SDPA, or None (with one WARNING saying why)."""
    try:
        fn = cpu_kernels.load("paged_decode", _SOURCE, "computron_paged_decode", _ARGS)
        fn.restype = ctypes.c_int
        _self_check(fn)
        return fn
    except Exception as exc:  # noqa: BLE001 - any failure means the gathered SDPA, never an error
        log.warning("the CPU paged decode attention kernel is not used (%s: %s); decode steps gather the KV "
                    "pool for the model's attention", type(exc).__name__, exc)
        return None


def available() -> bool:
    """Whether the kernel is built and right on this machine (built on the first call)."""
    return _kernel() is not None


def reference(query, pool_k, pool_v, slots, lengths, scale: float, window: int = 0) -> torch.Tensor:
    """What the kernel computes, by gathering and SDPA: ``[B, 1, H, D]``."""
    b, h, _, d = query.shape
    kvh, width = pool_k.shape[0], slots.shape[1]
    k, v = (p.index_select(1, slots.reshape(-1)).view(kvh, b, width, d).transpose(0, 1) for p in (pool_k, pool_v))
    pos = torch.arange(width)[None]
    ok = pos < lengths[:, None]
    if window:
        ok &= pos >= lengths[:, None] - window
    mask = torch.zeros(ok.shape, dtype=query.dtype).masked_fill_(~ok, float("-inf"))[:, None, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _run(fn, query, pool_k, pool_v, slots, lengths, scale: float, window: int) -> torch.Tensor:
    b, h, _, d = query.shape
    q = query.reshape(b, h, d).contiguous()
    out = torch.empty(b, 1, h, d, dtype=torch.float32)
    if fn(q.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(), slots.data_ptr(), lengths.data_ptr(),
          out.data_ptr(), b, h, pool_k.shape[0], d, pool_k.shape[1], slots.shape[1], scale, window):
        raise MemoryError("paged decode attention: no memory for its scores")
    return out


def _self_check(fn) -> None:
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, window in ((6, 2, 64, 0), (4, 4, 24, 5), (3, 1, 16, 0)):
        slots_n = 64
        pool_k, pool_v = (torch.randn(kv_heads, slots_n, dim, generator=gen) for _ in range(2))
        lengths = torch.tensor([1, 9, 17])
        slots = torch.randperm(slots_n, generator=gen)[:3 * 17].view(3, 17)
        query = torch.randn(3, heads, 1, dim, generator=gen)
        got = _run(fn, query, pool_k, pool_v, slots, lengths, dim ** -0.5, window)
        want = reference(query, pool_k, pool_v, slots, lengths, dim ** -0.5, window)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"its result differs from SDPA by {(got - want).abs().max().item():.3g}")


def decode(query, pool_k, pool_v, slots, lengths, scale: float, window: int = 0) -> torch.Tensor:
    """Attention of one new token per row, ``query`` ``[B, H, 1, D]``, over each row's first ``lengths[b]``
    slots of ``slots`` ``[B, W]`` (int64; the last ``window`` of them where ``window`` > 0) in the float32
    pools ``[KV heads, S, D]`` (contiguous): ``[B, 1, H, D]``, as transformers' attention functions return
    it. ``available()`` must be True."""
    return _run(_kernel(), query, pool_k, pool_v, slots, lengths, scale, window)


@torch.library.custom_op("computron::paged_decode", mutates_args=())
def paged_decode(query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """``decode`` as a torch operator, opaque to a compiled step (``decode_compile``)."""
    return decode(query, pool_k, pool_v, slots, lengths, scale, window)


@paged_decode.register_fake
def _(query, pool_k, pool_v, slots, lengths, scale, window):
    b, h, _, d = query.shape
    return query.new_empty(b, 1, h, d)


__all__ = ["available", "decode", "paged_decode", "reference"]
