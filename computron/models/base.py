"""What every runner is: ``StageContext`` (this rank's place: stage, TP rank, groups, device),
``StageRunner`` (a model's shard on one rank, its segments in execution order, a forward over a batch) and
``GenerativeRunner`` (token-level generation: steps, parking and dropping sequences, KV accounting), plus
the two splitting helpers every runner uses (``uniform_split`` for pipeline stages, ``parallelize`` for
TP plans)."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional

import torch
from torch import nn

from ..comm.messages import BatchingDefaults, ParkResult, StepResult  # what generative runners return


def uniform_split(n_items: int, parts: int) -> List[range]:
    """Split ``n_items`` into ``parts`` contiguous ranges whose sizes differ by at most one."""
    if parts > n_items:
        raise ValueError(f"cannot split {n_items} layers into {parts} pipeline stages")
    base, extra = divmod(n_items, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class StageContext:
    """What a runner needs to know about its rank."""
    groups: Any  # topology.Groups
    device: torch.device
    model_id: str = ""
    scatter_from: Optional[int] = 0
    """TP splitting: the rank whose full weights are scattered to the others (a collective on the TP group,
    as at start-up, when every rank builds its models in the same order on its command loop), or None:
    every rank cuts its own slices out of identical full weights without communicating, as a model added
    while serving must (it is built beside steps that use the same group)."""
    kv_cache: str = "dynamic"
    """``EngineConfig.kv_cache``: 'dynamic' or 'paged' (``kv_block_size`` tokens per block)."""
    kv_block_size: int = 16
    prefix_cache: bool = True
    """``EngineConfig.prefix_cache``: paged prompts start with the blocks earlier prompts cached."""
    compile_decode: str = "off"
    """``EngineConfig.compile_decode``: 'off', 'auto' or 'on' (``decode_compile.wants_compile``)."""
    kv_reserve: float = 0.1
    """``EngineConfig.kv_reserve``: the paged pool starts with this fraction of the stage's weight bytes."""
    pack_linears: bool = True
    """``EngineConfig.pack_cpu_linears``: a CPU rank's Linears run on weights packed for oneDNN."""
    cpu_attention: bool = True
    attention_backend: str = "auto"
    """``EngineConfig.attention_backend``: how a paged model's layers read the pool (``attention.choose``)."""
    """``EngineConfig.cpu_decode_attention``: a CPU rank's paged decode steps attend from the pool in place."""

    @property
    def layout(self):
        return self.groups.layout

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def stage(self) -> int:
        return self.groups.stage

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def is_output_rank(self) -> bool:
        return self.groups.rank == self.layout.output_rank

    def tp_mesh(self):
        from torch.distributed.device_mesh import DeviceMesh
        return DeviceMesh.from_group(self.groups.tp_group, self.device.type)


class StageRunner(abc.ABC):
    """This rank's part of one model: the module whose tensors the store holds, and how to run it."""

    ctx: StageContext
    module: nn.Module
    segments: List[nn.Module]

    def kv_bytes(self) -> int:
        """KV caches this runner holds on the device (none: it keeps nothing between commands)."""
        return 0

    def host_kv_bytes(self) -> int:
        """KV caches this runner parked in host memory."""
        return 0

    def release_resident(self) -> int:
        """The model left the device: drop what was derived from its resident weights (packed CPU weights);
        returns the bytes released."""
        from ..kernels.cpu.linear import release_packs
        return release_packs(self.module)

    def forget_prefixes(self) -> None:
        """An adapter left: no cached prompt KV computed with it may be used again (none is kept here)."""

    @abc.abstractmethod
    def run(self, batch: Any, weights_ready: Callable[[], None]) -> Optional[Any]:
        """Run one batch; return the output on the output rank, None on the others.

        ``weights_ready()`` waits until the first weights have arrived and raises if
        the model is not loaded here; it is called where a failure is passed on to
        the other ranks, so none of them waits for this one forever.
        """



class GenerativeRunner(StageRunner):
    """A runner that also generates token by token: it keeps a running batch of sequences, with their
    KV caches, between ``step`` commands."""

    @abc.abstractmethod
    def step(self, cmd: Any, weights_ready: Callable[[], None]) -> StepResult:
        """Run one ``messages.Step``: drop, prefill the admitted sequences, decode the running ones."""

    @abc.abstractmethod
    def park_running(self, recompute: Iterable[int]) -> ParkResult:
        """The model leaves the device: drop the sequences in ``recompute``, park the others."""

    @abc.abstractmethod
    def drop_sequences(self, sids: Iterable[int]) -> None:
        """Forget these sequences, parked or running."""

    @abc.abstractmethod
    def drop_all(self) -> None:
        """Forget every sequence, parked or running (the model is removed)."""

    @abc.abstractmethod
    def kv_bytes(self) -> int:
        """KV caches on the device (not those parked in host memory)."""

    @abc.abstractmethod
    def host_kv_bytes(self) -> int:
        """KV caches parked in host memory."""

    @abc.abstractmethod
    def batching_defaults(self) -> BatchingDefaults:
        """What the master's batch manager needs to know about this model's token ids."""


def parallelize(module: nn.Module, plan: dict, ctx: StageContext) -> None:
    """Split ``module`` by the TP ``plan`` (plain column- and row-parallel Linears then run on their local
    shards: ``local_tp``)."""
    if ctx.tp == 1 or not plan:
        return
    from .local_tp import split_linears
    split_linears(module, plan, ctx.tp_mesh(), ctx.groups.tp_group, ctx.scatter_from)
