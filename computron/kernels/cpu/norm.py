"""RMS norms of a model on a CPU as torch's one fused operator (``F.rms_norm``) where that is the same norm.

transformers' RMS norms (``LlamaRMSNorm`` and its copies) compute in seven eager operators (a cast, a
square, a mean, an add, a reciprocal square root and two products); a decode step of SmolLM2 runs 61 of
them. ``F.rms_norm`` is one operator with the same result bit for bit where the norm is Llama's formula:
about 13 against 16 us a call for one row of 576 features, one thread. Which classes have that formula is
not read from their names: each class is probed once per dtype (its forward and ``F.rms_norm`` on the same
random input and weight, compared with ``torch.equal``; only transformers' classes, on plain tensors), and
only a class whose results are identical is swapped (``FusedRMSNorm``: the same module object, its weight
and epsilon as they were). Gemma's norm (``1 + weight``) or one computing in another order keeps its own
forward. The figures: ``benchmarks/cpu_kernels.py``'s ``per_call`` (61 calls 0.78 against 0.99 ms)."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class FusedRMSNorm(nn.Module):
    """An RMS norm whose forward is ``F.rms_norm`` over its last dimension (``use_fused_norms`` swaps a
    module to it only after its class gave the same results)."""

    rms_eps = 1e-6

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.rms_eps)


def _eps(module: nn.Module):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _candidate(module: nn.Module) -> bool:
    """A norm of transformers' (not this project's: ``decoder_split.ShardedRMSNorm`` sums over its TP group)
    whose only state is a 1-D weight and an epsilon."""
    cls = type(module)
    if not cls.__name__.endswith("RMSNorm") or not cls.__module__.startswith("transformers.") \
            or _eps(module) is None:
        return False
    from ..._torch_compat import local_tensor
    params = dict(module.named_parameters(recurse=False))
    return (list(params) == ["weight"] and local_tensor(params["weight"]) is params["weight"]
            and params["weight"].dim() == 1 and not list(module.buffers())
            and not list(module.children()) and params["weight"].device.type == "cpu"
            and params["weight"].is_floating_point())


@functools.lru_cache(maxsize=None)
def same_as_fused(cls: type, dtype: torch.dtype, width: int, eps: float) -> bool:
    """Whether ``cls``'s forward gives ``F.rms_norm``'s results bit for bit in ``dtype`` (probed once)."""
    gen = torch.Generator().manual_seed(0)
    probe = cls.__new__(cls)
    nn.Module.__init__(probe)
    probe.weight = nn.Parameter(torch.randn(width, generator=gen).to(dtype), requires_grad=False)
    probe.variance_epsilon = probe.eps = eps
    x = (torch.randn(3, 5, width, generator=gen) * 3).to(dtype)
    try:
        with torch.no_grad():
            want = cls.forward(probe, x)
            got = F.rms_norm(x, (width,), probe.weight, eps)
    except Exception as exc:  # noqa: BLE001 - a norm that cannot be probed keeps its own forward
        log.debug("%s is not probed (%s: %s)", cls.__name__, type(exc).__name__, exc)
        return False
    return isinstance(want, torch.Tensor) and want.dtype == got.dtype and torch.equal(want, got)


def use_fused_norms(module: nn.Module) -> int:
    """Swap every RMS norm under ``module`` whose class computes ``F.rms_norm`` to ``FusedRMSNorm``; returns
    how many were swapped."""
    n = 0
    for sub in module.modules():
        if not _candidate(sub):
            continue
        eps, weight = _eps(sub), sub.weight
        if same_as_fused(type(sub), weight.dtype, weight.shape[0], eps):
            sub.__class__ = FusedRMSNorm
            sub.rms_eps = eps
            n += 1
    return n


__all__ = ["FusedRMSNorm", "same_as_fused", "use_fused_norms"]
