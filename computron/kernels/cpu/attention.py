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

It is single-threaded (used where a worker computes on one intra-op thread, as ``gemm`` is), float32,
and checked against SDPA before first use; where there is no compiler, the build fails or the check does,
``available()`` is False (one WARNING says why) and the pool gathers for the model's SDPA as before. The
hook into the model's attention is ``models.kv_pool``'s (``direct_fits``); a compiled decode step calls the kernel
as the opaque operator ``computron::paged_decode`` (``paged_decode``).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from importlib import resources

import torch

from . import build

log = logging.getLogger(__name__)

_SOURCE = resources.files(__package__).joinpath("attention.c").read_text()
"""The kernel's C source, shipped beside this module (``attention.c``)."""

_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 6 + [ctypes.c_float, ctypes.c_long]


@functools.lru_cache(maxsize=None)
def _kernel():
    """The compiled function, checked against SDPA, or None (with one WARNING saying why)."""
    try:
        fn = build.load("paged_decode", _SOURCE, "computron_paged_decode", _ARGS)
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
    """``decode`` as a torch operator, opaque to a compiled step (``models.decode_compile``)."""
    return decode(query, pool_k, pool_v, slots, lengths, scale, window)


@paged_decode.register_fake
def _(query, pool_k, pool_v, slots, lengths, scale, window):
    b, h, _, d = query.shape
    return query.new_empty(b, 1, h, d)


__all__ = ["available", "decode", "paged_decode", "reference"]
