"""RMS norms as one operator (``kernels/cpu/norm.py``): swapped only where their class computes
``F.rms_norm`` bit for bit, and then giving the same results; Gemma's norm and other formulas keep theirs."""
import torch
from torch import nn

from computron.kernels.cpu import norm as cpu_norm
from computron.kernels.cpu.norm import FusedRMSNorm, use_fused_norms


def _norm(cls, width=24, eps=1e-5):
    norm = cls(width, eps=eps)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


def test_llama_and_qwen3_norms_become_one_operator_with_the_same_results():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    for cls in (LlamaRMSNorm, Qwen3RMSNorm):
        norm = _norm(cls, eps=1e-6)
        x = torch.randn(2, 7, 24) * 5
        want = norm(x)
        root = nn.Sequential(norm)
        assert use_fused_norms(root) == 1
        assert type(norm) is FusedRMSNorm and norm.rms_eps == 1e-6
        assert torch.equal(norm(x), want)
        assert use_fused_norms(root) == 0            # swapped once


def test_gemma_and_other_formulas_keep_their_own_forward():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    class ScaledRMSNorm(nn.Module):               # a norm named as transformers names them, another formula
        def __init__(self, width, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))
            self.variance_epsilon = eps

        def forward(self, x):
            return 2 * self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    gemma, other = _norm(Gemma3RMSNorm), ScaledRMSNorm(24)
    assert use_fused_norms(nn.Sequential(gemma, other)) == 0
    assert type(gemma) is Gemma3RMSNorm and type(other) is ScaledRMSNorm
    assert not cpu_norm.same_as_fused(Gemma3RMSNorm, torch.float32, 24, 1e-6)
    assert not cpu_norm.same_as_fused(ScaledRMSNorm, torch.float32, 24, 1e-6)


def test_only_transformers_norms_are_probed():
    """A class of this project or of a user is never run on a probe (``ShardedRMSNorm`` would all-reduce)."""
    from computron.models.decoder_split import ShardedRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class LlamaLikeRMSNorm(LlamaRMSNorm):        # Llama's formula, but not transformers' class
        pass

    sharded = ShardedRMSNorm()
    sharded.weight, sharded.variance_epsilon = nn.Parameter(torch.ones(8)), 1e-6
    user = _norm(LlamaLikeRMSNorm)
    assert use_fused_norms(nn.Sequential(sharded, user)) == 0
    assert type(sharded) is ShardedRMSNorm and type(user) is LlamaLikeRMSNorm


def test_a_norm_that_cannot_be_probed_is_not_the_same():
    class BrokenRMSNorm(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))
            self.eps = 1e-6

        def forward(self, x):
            raise RuntimeError("needs a process group")

    assert not cpu_norm.same_as_fused(BrokenRMSNorm, torch.float32, 8, 1e-6)
