"""TP-split Linears on their local shards (``models/local_tp.py``): which plan entries leave DTensor's dispatch,
and that a split module keeps its DTensor weights, loses parallelize_module's hooks and computes what it did.

One process, a gloo group of one rank: the split and the class swap are the same at any size; the
numerics at TP=2 are the engine tests' (sharded generation and encoders equal transformers token for
token)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from computron.models.local_tp import ColumnParallelLinear, RowParallelLinear, _local_class, split_linears
from computron.models.families import FAMILIES


def test_default_column_and_row_styles_run_locally_others_keep_dtensor():
    assert _local_class(ColwiseParallel()) is ColumnParallelLinear
    assert _local_class(RowwiseParallel()) is RowParallelLinear
    assert _local_class(ColwiseParallel(output_layouts=Replicate())) is None  # gathered: DTensor's path
    assert _local_class(RowwiseParallel(input_layouts=Replicate())) is None
    assert _local_class(ColwiseParallel(use_local_output=False)) is None
    assert _local_class(object()) is None


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_plan_runs_on_local_shards(family):
    assert {p: _local_class(s) for p, s in family.tp_plan().items()} == \
        {**{p: ColumnParallelLinear for p in family.colwise}, **{p: RowParallelLinear for p in family.rowwise}}


@pytest.fixture
def one_rank_group():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_split_block_keeps_dtensor_weights_drops_hooks_and_equals_the_unsplit(one_rank_group):
    from torch.distributed.device_mesh import DeviceMesh
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4))
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        want = block(x)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(output_layouts=Replicate())}
    split_linears(block, plan, DeviceMesh.from_group(one_rank_group, "cpu"), one_rank_group, src_data_rank=0)

    assert type(block[0]) is ColumnParallelLinear and type(block[2]) is RowParallelLinear
    assert type(block[3]) is nn.Linear  # kept on DTensor's path, with its hooks
    assert not block[0]._forward_pre_hooks and not block[0]._forward_hooks
    assert not block[2]._forward_pre_hooks and not block[2]._forward_hooks
    assert block[3]._forward_pre_hooks or block[3]._forward_hooks
    assert isinstance(block[0].weight, DTensor) and block[0].weight.placements == (Shard(0),)
    assert isinstance(block[2].weight, DTensor) and block[2].weight.placements == (Shard(1),)
    with torch.no_grad():
        got = block(x)
    assert not isinstance(got, DTensor)
    torch.testing.assert_close(got, want)


def test_a_plan_that_may_hand_on_a_dtensor_stays_on_dtensors_path(one_rank_group):
    from torch.distributed.device_mesh import DeviceMesh
    block = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    plan = {"0": ColwiseParallel(use_local_output=False), "1": RowwiseParallel()}
    split_linears(block, plan, DeviceMesh.from_group(one_rank_group, "cpu"), one_rank_group, src_data_rank=0)
    assert type(block[0]) is nn.Linear and type(block[1]) is nn.Linear
