"""The byte layouts a quantized Linear weight is kept in, and their dequantization in torch's own operators.

A quantized weight of ``out`` x ``in`` features is one ``uint8`` tensor of ``out`` rows: each row holds its
output feature's ``in`` weights as consecutive self-contained blocks of ``Format.block`` weights
(``Format.block_bytes`` bytes each). A tensor-parallel split by output features keeps whole rows; a split by
input features keeps, in every row, the blocks of its input range, so a block is never cut across ranks
(``check_split`` refuses a split that would cut one, with the numbers). The host copy, the disk tier and the
swap hold these bytes; what the device computes with is made from them on arrival (``quant.linear``).

The formats:

- GGUF's ``Q4_0``, ``Q4_1``, ``Q8_0`` (blocks of 32), ``Q4_K``, ``Q5_K``, ``Q6_K`` (super-blocks of 256):
  llama.cpp's block bytes as the file holds them (ggml-common.h's ``block_q4_0`` ... ``block_q6_K``);
- ``int4-gG`` (G = 32, 64, 128 or 256), what ``quantization: int4`` makes of a float weight: a block of G
  weights is a float16 step ``d``, a float16 minimum ``m`` and G/2 bytes of 4-bit codes ``q`` (the first
  G/2 weights in the low nibbles, the rest in the high ones), ``w = q * d + m``; ``int4-g32`` is exactly
  GGUF's ``Q4_1``, so a Q4_1 file and an int4 quantization share one code path;
- ``int8``, what ``quantization: int8`` makes: per output channel, a row is its ``in`` int8 codes then the
  channel's float32 scale, ``w = q * scale`` (any input split keeps the scale with each part of the row).

Every dequantizer returns float32 ``[rows, in]``; the 4-bit ones also give their codes with a step and an
offset per group of 32 or G (``four_bit``), what torch's int4 matmul takes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from .names import INT4_GROUPS, quantization_kind

QK_K = 256


@dataclass(frozen=True)
class Format:
    name: str
    """``gguf:Q4_1``, ``int4-g128``, ``int8``: how ``/v1/models`` and the logs name it."""
    block: int
    """Weights per block along the input features (0: the whole row is one block, ``int8``)."""
    block_bytes: int
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]
    """``[n, block_bytes]`` uint8 -> ``[n, block]`` float32."""
    four_bit: Optional[Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = None
    """``[n, block_bytes]`` -> (codes ``[n, block]`` 0..15, step and offset ``[n, block // group]``) with
    ``w = codes * step + offset`` per group of ``group`` weights; None for other formats."""
    group: int = 0

    def row_bytes(self, n_in: int) -> int:
        if self.block == 0:
            return n_in + 4
        return n_in // self.block * self.block_bytes

    def dequantize(self, data: torch.Tensor, n_in: int) -> torch.Tensor:
        """Float32 ``[rows, n_in]`` from this format's ``[rows, row_bytes(n_in)]`` bytes."""
        rows = data.shape[0]
        if self.block == 0:
            return _int8_rows(data, n_in)
        blocks = data.reshape(rows * (n_in // self.block), self.block_bytes)
        return self.dequantize_blocks(blocks).reshape(rows, n_in)

    def check_split(self, n_in: int, parts: int, what: str) -> None:
        """ValueError when ``n_in`` input features cannot be split in ``parts`` whole blocks per part."""
        if self.block == 0:
            return
        if n_in % self.block:
            raise ValueError(f"{what}: {n_in} input features are not a whole number of {self.name} blocks of "
                             f"{self.block}")
        if parts > 1 and (n_in // self.block) % parts:
            raise ValueError(f"{what}: {n_in} input features are {n_in // self.block} {self.name} blocks of "
                             f"{self.block}, which {parts} tensor-parallel ranks cannot share evenly without "
                             f"cutting a block (each rank needs a multiple of {self.block} input features)")


def _u8(values, like: torch.Tensor) -> torch.Tensor:
    """Shift amounts on ``like``'s device."""
    return torch.tensor(list(values), dtype=torch.uint8, device=like.device)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, b]`` bytes -> ``[n, 2b]`` codes: the low nibbles of all, then the high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_1_like(block: int) -> Tuple[Callable, Callable]:
    def four_bit(blocks):
        return _nibbles(blocks[:, 4:]), _f16(blocks, 0), _f16(blocks, 2)

    def deq(blocks):
        q, d, m = four_bit(blocks)
        return q.float() * d + m
    return deq, four_bit


def _q4_0_four_bit(blocks):
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:]), d, -8 * d


def _q4_0(blocks):
    q, d, off = _q4_0_four_bit(blocks)
    return q.float() * d + off


def _q8_0(blocks):
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def _k_scales(scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins of a K-quant super-block's 8 sub-blocks from its 12 bytes."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _q4_k_four_bit(blocks):
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    step = _f16(blocks, 0) * sc
    offset = -_f16(blocks, 2) * mn
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> _u8([0, 4], blocks).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(n, QK_K), step, offset


def _q4_k(blocks):
    n = blocks.shape[0]
    q, step, offset = _q4_k_four_bit(blocks)
    return (q.reshape(n, 8, 32).float() * step[..., None] + offset[..., None]).reshape(n, QK_K)


def _q5_k(blocks):
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    step = (_f16(blocks, 0) * sc)[..., None]
    offset = (_f16(blocks, 2) * mn)[..., None]
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    low = (qs.reshape(n, 4, 1, 32) >> _u8([0, 4], blocks).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 1, 32) >> _u8(range(8), blocks).reshape(1, 8, 1)) & 0x01
    q = low.reshape(n, 8, 32) | (high << 4)
    return (q.float() * step - offset).reshape(n, QK_K)


def _q6_k(blocks):
    n = blocks.shape[0]
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = _f16(blocks, 208) * scales.contiguous().view(torch.int8).float()
    low = (ql.reshape(n, 2, 1, 64) >> _u8([0, 4], blocks).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> _u8([0, 2, 4, 6], blocks).reshape(1, 1, 4, 1)) & 0x03
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).to(torch.int16) - 32
    return (q.reshape(n, 16, 16).float() * d[..., None]).reshape(n, QK_K)


def _int8_rows(data: torch.Tensor, n_in: int) -> torch.Tensor:
    q = data[:, :n_in].contiguous().view(torch.int8)
    return q.float() * int8_scales(data, n_in)[:, None]


def int8_scales(data: torch.Tensor, n_in: int) -> torch.Tensor:
    """The float32 per-channel scales of ``int8`` rows."""
    return data[:, n_in:n_in + 4].contiguous().view(torch.float32).reshape(-1)


_Q41 = _q4_1_like(32)
GGUF_FORMATS: Dict[str, Format] = {
    "Q4_0": Format("gguf:Q4_0", 32, 18, _q4_0, _q4_0_four_bit, 32),
    "Q4_1": Format("gguf:Q4_1", 32, 20, _Q41[0], _Q41[1], 32),
    "Q8_0": Format("gguf:Q8_0", 32, 34, _q8_0),
    "Q4_K": Format("gguf:Q4_K", QK_K, 144, _q4_k, _q4_k_four_bit, 32),
    "Q5_K": Format("gguf:Q5_K", QK_K, 176, _q5_k),
    "Q6_K": Format("gguf:Q6_K", QK_K, 210, _q6_k),
}
"""GGUF's quantized block types served without converting to float, by llama.cpp's type name."""

INT8 = Format("int8", 0, 0, _int8_rows)


def int4_format(group: int) -> Format:
    if group not in INT4_GROUPS:
        raise ValueError(f"int4 group size {group}: must be one of {INT4_GROUPS}")
    deq, four_bit = _q4_1_like(group)
    return Format(f"int4-g{group}", group, 4 + group // 2, deq, four_bit, group)


def parse_quantization(value) -> Optional[Format]:
    """The format a ``ModelConfig.quantization`` value names (None for None); ValueError otherwise."""
    if value is None:
        return None
    kind, group = quantization_kind(value)
    return INT8 if kind == "int8" else int4_format(group)


def quantize(weight: torch.Tensor, fmt: Format) -> torch.Tensor:
    """A float ``[out, in]`` weight in ``fmt``'s bytes (``int8`` or ``int4-gG``): round to nearest."""
    w = weight.detach().float()
    rows, n_in = w.shape
    if fmt.block == 0:
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8), scale.reshape(rows, 1).contiguous().view(torch.uint8)], dim=1)
    fmt.check_split(n_in, 1, "quantize")
    g = w.reshape(-1, fmt.block)
    lo, hi = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    dq = d.float()
    q = torch.round((g - m.float()) / torch.where(dq > 0, dq, torch.ones_like(dq))).clamp_(0, 15).to(torch.uint8)
    half = fmt.block // 2
    packed = q[:, :half] | (q[:, half:] << 4)
    blocks = torch.cat([d.view(torch.uint8), m.view(torch.uint8), packed], dim=1)
    return blocks.reshape(rows, fmt.row_bytes(n_in))


__all__ = ["Format", "GGUF_FORMATS", "INT8", "INT4_GROUPS", "int4_format", "int8_scales", "parse_quantization",
           "quantize", "QK_K"]
