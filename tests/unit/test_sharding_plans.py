"""Sharding plans: which layers are split how, and inputs they refuse (no processes needed)."""
import pytest
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from computron import ModelConfig, zoo
from computron.models import causal_lm_family, uniform_split
from computron.models.sequential import linear_pair_plan


def kinds(plan):
    return {k: type(v).__name__ for k, v in plan.items()}


def test_linear_pairs_only_across_elementwise_modules():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(), nn.Linear(8, 4), nn.LayerNorm(4),
                        nn.Linear(4, 8), nn.Softmax(-1), nn.Linear(8, 2))
    plan = linear_pair_plan(seq)
    assert kinds(plan) == {"0": "ColwiseParallel", "3": "RowwiseParallel", "5": "ColwiseParallel",
                           "7": "ColwiseParallel"}
    assert isinstance(plan["3"], RowwiseParallel) and isinstance(plan["7"], ColwiseParallel)


def test_uniform_split():
    assert [list(r) for r in uniform_split(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in uniform_split(7, 3)] == [3, 2, 2]
    with pytest.raises(ValueError, match="3 layers into 4 pipeline stages"):
        uniform_split(3, 4)


def test_families():
    assert causal_lm_family(zoo.random_causal_lm("opt-tiny")) == "opt"
    assert causal_lm_family(zoo.random_causal_lm("llama-tiny")) == "llama"
    assert causal_lm_family(zoo.mlp()) is None


def test_pipelinable_false_refuses_pipeline_split():
    from types import SimpleNamespace

    from computron.models import make_runner
    ctx = SimpleNamespace(pp=2)
    with pytest.raises(ValueError, match="pipelinable=False"):
        make_runner(zoo.mlp(), ModelConfig("m", zoo.mlp, pipelinable=False), ctx)
