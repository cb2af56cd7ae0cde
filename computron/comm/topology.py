"""Where each rank sits: pipeline stage, tensor-parallel rank, and its process groups.

Worker ranks are laid out stage-major: global worker rank ``w = s * tp + t``.
In spawn mode the master is one extra rank after the workers; in attach mode
(torchrun / colossalai run) the master lives inside global rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    master_rank: int
    """Global rank that hosts the master's side of the control plane."""
    master_is_worker: bool
    """True in attach mode: the master shares global rank 0 with worker 0."""

    @property
    def n_workers(self) -> int:
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        return self.n_workers + (0 if self.master_is_worker else 1)

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> List[int]:
        return [stage * self.tp + t for t in range(self.tp)]

    @property
    def output_rank(self) -> int:
        """The rank whose batch output goes back to the master: last stage, tp rank 0."""
        return (self.pp - 1) * self.tp


class Groups:
    """Process groups, created identically and in the same order on every rank."""

    # The control plane sits idle between requests: its receives must not time out.
    # (Gloo keeps the timeout in int32 milliseconds in places: stay under ~24 days.)
    IDLE_TIMEOUT = timedelta(days=20)

    def __init__(self, layout: Layout, rank: int, data_backend: str, data_timeout: timedelta):
        import torch.distributed as dist
        self.layout = layout
        self.rank = rank
        everyone = list(range(layout.world_size))
        workers = list(range(layout.n_workers))
        self.cmd = dist.new_group(everyone, backend="gloo", timeout=self.IDLE_TIMEOUT)
        self.res = dist.new_group(everyone, backend="gloo", timeout=self.IDLE_TIMEOUT)
        # data plane: a peer that stays silent this long is taken for dead
        self.data = dist.new_group(workers, backend=data_backend, timeout=data_timeout)
        self.tp_groups = [dist.new_group(layout.stage_ranks(s), backend=data_backend, timeout=data_timeout)
                          for s in range(layout.pp)]

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank_of(self.rank)

    @property
    def tp_group(self):
        return self.tp_groups[self.stage]

    def prev_rank(self) -> Optional[int]:
        return None if self.stage == 0 else self.rank - self.layout.tp

    def next_rank(self) -> Optional[int]:
        return None if self.stage == self.layout.pp - 1 else self.rank + self.layout.tp
