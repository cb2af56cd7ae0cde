"""``QuantLinear``: a Linear whose weight is held in a quantized format's bytes, and what it computes with.

The module's one weight tensor is the ``qdata`` buffer (``uint8 [out, row_bytes]``, ``formats``): the shard
store parks, reads and swaps those bytes like any other tensor. What the device computes with is made from
them when they arrive (``computron_arrive``, called by the store as each segment lands; also on a forward
that finds it missing) and dropped when they leave (``computron_leave``), in one of two modes chosen per
model at load:

- ``expand``: the weight dequantized into the compute dtype; products as a float Linear's (on a CPU
  ``cpu_linear.linear``, packing included), so a resident model runs as its float self does;
- ``packed``: codes kept packed and multiplied by torch's own operators: ``_weight_int8pack_mm`` for
  ``int8``; for the 4-bit formats (``int4-gG``, ``Q4_0``, ``Q4_1``, ``Q4_K``) ``_weight_int4pack_mm_for_cpu``
  on a CPU and ``_weight_int4pack_mm`` (bfloat16) on CUDA; the other formats (``Q8_0``, ``Q5_K``,
  ``Q6_K``) dequantize at each product into a temporary and ``F.linear`` it, as every format does for a
  product of more than ``PACKED_MAX_ROWS`` rows (a long prefill).

A ``QuantLinear`` is not an ``nn.Linear``, so ``cpu_linear.use_cpu_kernels`` leaves its class alone. Split by
tensor parallelism it behaves as the Linear it replaced: ``tp_group`` set, it is row-parallel (its slice of
the inputs in, the partial products all-reduced, the bias added once); otherwise it returns its slice of
the outputs (column-parallel) or all of them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._torch_compat import local_tensor
from ..kernels.cpu import linear as cpu_linear
from .formats import Format, int8_scales

MODES = ("expand", "packed")
PACKED_MAX_ROWS = 64
"""Rows (tokens) above which a ``packed`` product dequantizes into a temporary and runs ``F.linear`` instead:
torch's int4 CPU matmul took over 600 s for SmolLM2's 2,021-token prefill on 2 busy cores
(``benchmarks/compressed.py``), where decode steps of 1 to 8 rows are what packing is for."""


class QuantLinear(nn.Module):
    """See the module docstring. Built by ``quant.apply`` from a Linear (class swap), never directly."""

    fmt: Format
    mode: str = "expand"
    compute_dtype: torch.dtype = torch.float32
    n_in: int = 0
    """This rank's input features (the weight's columns held in ``qdata``)."""
    tp_group = None
    uses_cpu_linear = True
    pack_weights = False

    def extra_repr(self) -> str:
        return (f"in_features={self.n_in}, out_features={self.qdata.shape[0]}, format={self.fmt.name}, "
                f"mode={self.mode}, bias={self.bias is not None}")

    # ---- what the device computes with ---------------------------------------------------------------
    def computron_arrive(self) -> None:
        """Make what the products use from ``qdata`` (its bytes have just arrived)."""
        data = self.qdata
        key = (data.data_ptr(), data.device, data._version)
        if self.__dict__.get("_made_from") == key:
            return
        self.__dict__["_state"] = None
        self.__dict__["_state"] = self._make(data)
        self.__dict__["_made_from"] = key

    def computron_leave(self) -> None:
        """Drop what ``computron_arrive`` made (the device copy is going)."""
        for k in ("_state", "_made_from"):
            self.__dict__.pop(k, None)

    def computron_made_bytes(self) -> int:
        """Device bytes ``computron_arrive`` will make beside ``qdata`` (what a device budget must also hold)."""
        if self.mode == "expand":
            return self.qdata.shape[0] * self.n_in * self.compute_dtype.itemsize
        return self.qdata.numel() if self.fmt.block == 0 or self.fmt.four_bit is not None else 0

    def computron_device_bytes(self) -> int:
        """Device bytes held beside ``qdata`` by what the products use."""
        state = self.__dict__.get("_state")
        if state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (state if isinstance(state, tuple) else (state,))
                   if isinstance(t, torch.Tensor))

    def _make(self, data: torch.Tensor):
        fmt, n_in = self.fmt, self.n_in
        if self.mode == "expand":
            return fmt.dequantize(data, n_in).to(self.compute_dtype)
        if fmt.block == 0:  # int8: codes and scales as _weight_int8pack_mm takes them
            return ("int8", data[:, :n_in].contiguous().view(torch.int8), int8_scales(data, n_in))
        if fmt.four_bit is not None:
            return _int4_state(fmt, data, n_in)
        return ("dequantize",)

    def _product(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        state = self.__dict__.get("_state")
        if state is None or self.__dict__.get("_made_from", (None,))[0] != self.qdata.data_ptr():
            self.computron_arrive()
            state = self.__dict__["_state"]
        if self.mode == "expand":
            return cpu_linear.linear(x, state, bias, self)
        kind = state[0]
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > PACKED_MAX_ROWS:
            kind = "dequantize"
        if kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(flat, state[1], state[2].to(flat.dtype))
        elif kind == "int4-cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, state[1], self.fmt.group, state[2].to(flat.dtype))
        elif kind == "int4-cuda":
            y = torch.ops.aten._weight_int4pack_mm(flat.to(torch.bfloat16), state[1], self.fmt.group,
                                                   state[2]).to(flat.dtype)
        else:
            return F.linear(x, self.fmt.dequantize(self.qdata, self.n_in).to(x.dtype), bias)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def forward(self, x):
        bias = None if self.bias is None else local_tensor(self.bias)
        if self.tp_group is None:
            return self._product(x, bias)
        y = self._product(x, None)
        dist.all_reduce(y, group=self.tp_group)
        return y if bias is None else y + bias


def _int4_state(fmt: Format, data: torch.Tensor, n_in: int):
    """Codes packed for torch's int4 matmul with ``[groups, out, 2]`` (step, offset) pairs: its weights are
    ``(code - 8) * step + offset'``, so ``offset' = offset + 8 * step`` gives ``code * step + offset``."""
    rows = data.shape[0]
    blocks = data.reshape(rows * (n_in // fmt.block), fmt.block_bytes)
    codes, step, offset = fmt.four_bit(blocks)
    codes = codes.reshape(rows, n_in)
    step = step.reshape(rows, n_in // fmt.group)
    zero = offset.reshape(rows, n_in // fmt.group) + 8 * step
    pairs = torch.stack([step, zero], dim=-1).transpose(0, 1).contiguous()
    if data.device.type == "cuda":  # tiles of 16 * k input features: the largest k of 8, 4, 2 that divides them
        tiles = next((k for k in (8, 4, 2) if n_in % (16 * k) == 0), None)
        if tiles is None:
            return ("dequantize",)
        pairs = pairs.to(torch.bfloat16)
        nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return "int4-cuda", torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), tiles), pairs
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    return "int4-cpu", packed, pairs


__all__ = ["QuantLinear", "MODES"]
