"""Linears of a few rows on a multi-threaded CPU: the product computed weight-first.

A Linear computes ``x @ W^T`` for activations ``x`` of ``M`` rows. A decode step has one row per sequence
and a short prefill a few dozen, and for such ``M`` the BLAS in torch's CPU wheels (MKL) spreads the
``x @ W^T`` form poorly over its threads. On this 2-core machine (AMD EPYC, 2 threads), one pass through
every Linear of opt-125m, LM head included, computed as ``(W @ x^T)^T`` took 0.36-0.75x as long as
computed as ``x @ W^T``, for 2 to 64 rows; a decode step of 8 sequences went from 174 to 125 ms, a
16-token prefill from 186 to 125 ms (``benchmarks/cpu_linear.py``). With one thread the weight-first pass
took 0.58-1.04x, a whole model's step within noise; for one row both forms are a matrix-vector product.

So on a CPU, with more than one intra-op thread and ``2 <= M <= MAX_ROWS``, ``linear`` computes the
weight-first product (the bias added by the same ``addmm``) and returns it contiguous, as ``F.linear``
would; everywhere else, and on every other device, it is ``F.linear``. The sums are the same products in
another order: results agree with ``F.linear`` to float rounding, as a batched row already differs from
the same row computed alone.

``use_few_row_kernel(module)`` makes a runner's plain ``nn.Linear`` modules call it (a class swap: the
same module objects, hooks and all).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64
"""The most rows computed weight-first: the largest row count measured; a longer prefill keeps ``F.linear``."""


def weight_first(flat: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``flat @ weight^T (+ bias)`` for a 2-D ``flat``, computed as ``(weight @ flat^T)^T``, contiguous."""
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias[:, None], weight, flat.t())
    return out.t().contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, weight-first where that is faster (see the module's docstring)."""
    if x.device.type != "cpu" or x.dim() < 2 or x.dtype != weight.dtype or torch.get_num_threads() < 2:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 2 <= rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    out = weight_first(x.reshape(rows, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class FewRowLinear(nn.Linear):
    """An ``nn.Linear`` whose product is ``linear``'s."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def use_few_row_kernel(module: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` under ``module`` to ``FewRowLinear``, but those split by DTensor (whose
    product DTensor's dispatch computes); returns how many."""
    from .._torch_compat import local_tensor
    n = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and local_tensor(sub.weight) is sub.weight:
            sub.__class__ = FewRowLinear
            n += 1
    return n


__all__ = ["linear", "weight_first", "FewRowLinear", "use_few_row_kernel", "MAX_ROWS"]
