"""A runner's LoRA adapters on the device, every row of a step with its own adapter (worker side).

The adapters of one base live in host memory (``weights.RankAdapter``, added and removed by commands);
``max_loras`` of them at a time also live in *device slots*: for every base Linear some adapter changes,
two persistent stacks ``A`` [slots + 1, R, in] and ``Bt`` [slots + 1, R, out] (``Bt`` = scaling * B^T:
stored transposed so that filling a slot is two contiguous copies), with ``slots`` = min(max_loras, adapters
added) and ``R`` the highest rank added (at most ``max_rank``): device memory follows the adapters there
are, not the limits. Slot 0 stays zero: the bare base's rows. A rank below ``R`` is zero-padded, and a
module an adapter does not change holds zeros in its slot, so every row can run through the same two
batched matmuls::

    h = bmm(x, A[idx, :r]^T)        # [batch, seq, r]; all-reduced over the TP group when the base is
    y = y + bmm(h, Bt[idx, :r])     #   row-parallel (x is then this rank's slice of the in-features)

with ``idx`` the rows' slots and ``r`` the largest rank of this step's adapters: one matmul pair per
module per step, not one per adapter (the gathered form of Punica's/S-LoRA's batched LoRA, in plain
torch). When every row uses the same adapter the gather is skipped.

``activate(rows)`` before a forward makes every adapter of the step resident (least recently used
leaves first, never one this step uses; more distinct adapters than slots is ``TooManyAdapters``) and
sets the slot index; ``deactivate()`` after it (``with slots.active(rows):`` does both). Forward hooks on
the target Linears are installed when an adapter first targets one and removed when the last leaves;
outside an active step they cost one attribute check. ``drop_device`` frees every slot when the base
leaves the device. Not thread-safe: call it from the thread that runs the runner.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .adapter import AdapterError
from .weights import RankAdapter, linear_split


class TooManyAdapters(ValueError):
    """One step uses more distinct adapters than a base has device slots (``max_loras``)."""


class _Target:
    """One base Linear that some added adapter changes: its forward hook, its device stacks."""

    def __init__(self, slots: "LoraSlots", key: Tuple[int, str], module: torch.nn.Module):
        split = linear_split(module)
        self.slots, self.key = slots, key
        self.name = f"layer {slots.runner.layer_ids[key[0]]} {key[1]}"
        self.row_parallel = split.row_parallel
        self.in_local, self.out_local = split.in_local, split.out_local
        self.users: set = set()
        self.A: Optional[torch.Tensor] = None
        self.Bt: Optional[torch.Tensor] = None
        self.on = False
        """An adapter of the active step changes this module (the hook's only check otherwise)."""
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if not self.on:
            return None
        return self.slots._lora_forward(self, args[0], out)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.A, self.Bt) if t is not None)


class LoraSlots:
    """The LoRA adapters of one ``CausalLMRunner`` (this rank's layers and TP slices)."""

    def __init__(self, runner, max_loras: int, max_rank: int):
        if int(max_loras) < 1 or int(max_rank) < 1:
            raise ValueError(f"LoraSlots: max_loras={max_loras} and max_rank={max_rank} must be >= 1")
        self.runner, self.max_loras, self.max_rank = runner, int(max_loras), int(max_rank)
        ctx = runner.ctx
        self.device = ctx.device
        self._tp_group = ctx.groups.tp_group if ctx.tp > 1 else None
        self._host: Dict[str, RankAdapter] = {}
        self._targets: Dict[Tuple[int, str], _Target] = {}
        self._slot_of: "OrderedDict[str, int]" = OrderedDict()
        """Device-resident adapters and their slots, least recently used first."""
        self._active: Optional[Tuple[str, ...]] = None
        self._idx: Optional[torch.Tensor] = None
        self._uniform: Optional[int] = None
        self._r = 0
        self._shape: Optional[Tuple[int, int]] = None
        """(slots incl. the zero slot, rank) of the allocated stacks: what the added adapters need, grown
        (and refilled lazily) as adapters come, never more than (max_loras + 1, max_rank)."""
        self.fills = 0
        """Adapters brought into a device slot so far (``fill_s``: the seconds their copies took)."""
        self._fill_s = 0.0
        self._fill_events: list = []
        """CUDA: (start, end) events of fills not yet added to ``_fill_s`` (timed on the stream, never
        waited for in a step: ``fill_s`` reads them when asked)."""

    # ---- host copies -----------------------------------------------------------------------------
    def add(self, adapter_id: str, rank_adapter: RankAdapter) -> None:
        """Keep ``rank_adapter`` (host memory) and hook the Linears it changes; no device memory yet."""
        if adapter_id in self._host:
            raise AdapterError(adapter_id, "is already added to this model (remove it first)")
        if rank_adapter.r > self.max_rank:
            raise AdapterError(adapter_id, f"rank r={rank_adapter.r} exceeds max_lora_rank={self.max_rank}")
        for key, (a, bt) in rank_adapter.weights.items():
            split = linear_split(self._module(key))
            if a.shape != (rank_adapter.r, split.in_local) or bt.shape != (rank_adapter.r, split.out_local):
                raise AdapterError(adapter_id, f"{key[1]} of local layer {key[0]}: A {tuple(a.shape)} / B^T "
                                               f"{tuple(bt.shape)} do not fit this rank's slice of the base "
                                               f"(in {split.in_local}, out {split.out_local})")
        for key in rank_adapter.weights:
            if key not in self._targets:
                self._targets[key] = _Target(self, key, self._module(key))
            self._targets[key].users.add(adapter_id)
        self._host[adapter_id] = rank_adapter

    def remove(self, adapter_id: str) -> None:
        """Forget an adapter: its device slot and host copy (and the hooks no other adapter needs)."""
        if self._active is not None and adapter_id in self._active:
            raise RuntimeError(f"adapter {adapter_id!r} is in use by the running forward")
        ra = self._host.pop(adapter_id, None)
        if ra is None:
            raise AdapterError(adapter_id, "is not added to this model")
        self._slot_of.pop(adapter_id, None)
        for key in ra.weights:
            target = self._targets[key]
            target.users.discard(adapter_id)
            if not target.users:
                target.handle.remove()
                del self._targets[key]

    def adapters(self) -> Tuple[str, ...]:
        """The ids of the added adapters."""
        return tuple(self._host)

    def resident(self) -> Tuple[str, ...]:
        """The adapters in device slots, least recently used first."""
        return tuple(self._slot_of)

    def host_bytes(self) -> int:
        return sum(ra.nbytes for ra in self._host.values())

    def device_bytes(self) -> int:
        return sum(t.nbytes() for t in self._targets.values())

    @property
    def applying(self) -> bool:
        """Whether the forward under way applies some adapter (between ``activate`` and ``deactivate``)."""
        return bool(self._active)

    # ---- one step --------------------------------------------------------------------------------
    def activate(self, row_adapters: Sequence[Optional[str]]) -> None:
        """Before a forward: row ``i`` of the batch runs with adapter ``row_adapters[i]`` (None: the base)."""
        if self._active is not None:
            raise RuntimeError("LoraSlots.activate: already active (deactivate() after every forward)")
        rows = list(row_adapters)
        used = tuple(dict.fromkeys(a for a in rows if a is not None))
        for a in used:
            if a not in self._host:
                raise AdapterError(a, "is not added to this model on this rank")
        if len(used) > self.max_loras:
            raise TooManyAdapters(f"one step uses {len(used)} LoRA adapters {list(used)}, more than "
                                  f"max_loras={self.max_loras} device slots")
        if not used:  # bare base only: every hook stays off
            self._active = ()
            return
        with torch.inference_mode(False), torch.no_grad():  # stacks must stay writable outside inference
            self._allocate()
            for a in used:
                if a not in self._slot_of:
                    slot = self._timed_fill(a, used)
                    self._slot_of[a] = slot
                self._slot_of.move_to_end(a)
            slots = [self._slot_of[a] if a is not None else 0 for a in rows]
            idx = torch.tensor(slots, dtype=torch.long)
            if self.device.type == "cuda":
                idx = idx.pin_memory()
            self._idx = idx.to(self.device, non_blocking=True)
        self._uniform = slots[0] if len(set(slots)) == 1 else None
        self._r = max(self._host[a].r for a in used)
        self._active = used
        for t in self._targets.values():
            t.on = not t.users.isdisjoint(used)

    def deactivate(self) -> None:
        """After the forward (also when it failed): every hook off."""
        for t in self._targets.values():
            t.on = False
        self._active, self._idx, self._uniform = None, None, None

    @contextmanager
    def active(self, row_adapters: Sequence[Optional[str]]) -> Iterator[None]:
        self.activate(row_adapters)
        try:
            yield
        finally:
            self.deactivate()

    def _timed_fill(self, adapter_id: str, in_use: Tuple[str, ...]) -> int:
        slot = self._free_slot(in_use)
        self.fills += 1
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            self._fill(adapter_id, slot)
            self._fill_s += time.perf_counter() - t0
            return slot
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._fill(adapter_id, slot)
        end.record()
        self._fill_events.append((start, end))
        return slot

    @property
    def fill_s(self) -> float:
        """Seconds the device-slot fills took so far (on CUDA, waits for the last fill's copy to end)."""
        for start, end in self._fill_events:
            end.synchronize()
            self._fill_s += start.elapsed_time(end) / 1e3
        self._fill_events.clear()
        return self._fill_s

    def drop_device(self) -> None:
        """The base leaves the device: free every slot (the host copies stay)."""
        if self._active is not None:
            raise RuntimeError("LoraSlots.drop_device during a forward")
        self._free_stacks()

    def _free_stacks(self) -> None:
        for t in self._targets.values():
            t.A = t.Bt = None
        self._slot_of.clear()
        self._shape = None

    # ---- internals -------------------------------------------------------------------------------
    def _module(self, key: Tuple[int, str]) -> torch.nn.Module:
        return self.runner.base.layers[key[0]].get_submodule(key[1])

    def _allocate(self) -> None:
        """Zeroed stacks for every target that has none (a new target: no resident adapter changes it),
        sized for the added adapters: more of them, or a higher rank, than the stacks hold frees them all
        first (the resident adapters are copied in again as steps use them; adding adapters is rare)."""
        need = (min(self.max_loras, len(self._host)) + 1, max(ra.r for ra in self._host.values()))
        if self._shape is None or need[0] > self._shape[0] or need[1] > self._shape[1]:
            self._free_stacks()
            self._shape = need
        n, rank = self._shape
        for t in self._targets.values():
            if t.A is None:
                dtype = self._module(t.key).weight.dtype
                t.A = torch.zeros(n, rank, t.in_local, dtype=dtype, device=self.device)
                t.Bt = torch.zeros(n, rank, t.out_local, dtype=dtype, device=self.device)

    def _free_slot(self, in_use: Tuple[str, ...]) -> int:
        taken = set(self._slot_of.values())
        for s in range(1, self._shape[0]):
            if s not in taken:
                return s
        victim = next(a for a in self._slot_of if a not in in_use)  # exists: len(in_use) <= slots
        return self._slot_of.pop(victim)

    def _fill(self, adapter_id: str, slot: int) -> None:
        ra = self._host[adapter_id]
        for key, t in self._targets.items():
            w = ra.weights.get(key)
            r = 0 if w is None else w[0].shape[0]
            if w is not None:
                t.A[slot, :r].copy_(w[0], non_blocking=True)
                t.Bt[slot, :r].copy_(w[1], non_blocking=True)
            t.A[slot, r:].zero_()
            t.Bt[slot, r:].zero_()

    def _lora_forward(self, t: _Target, x, out):
        """The hook's work: ``out + scaling * (x A^T) B^T`` for every row with its own slot."""
        if isinstance(x, DTensor):  # a Linear left on DTensor's path (models/local_tp.py) gets a DTensor
            x = x.to_local()
        y = out.to_local() if isinstance(out, DTensor) else out
        idx, r = self._idx, self._r
        rows = idx.shape[0]
        if x.dim() < 2 or (x.numel() // x.shape[-1]) % rows:
            raise RuntimeError(f"LoRA: {t.name} got input {tuple(x.shape)}, not [batch={rows}, ..., features] "
                               "for the activated rows")
        # [batch, seq, in]; OPT feeds fc1/fc2 [batch * seq, in], flattened batch-major
        x = x.reshape(rows, -1, x.shape[-1]).to(t.A.dtype)
        if self._uniform is not None:
            h = torch.matmul(x, t.A[self._uniform, :r].t())
        else:
            h = torch.bmm(x, t.A[:, :r].index_select(0, idx).transpose(1, 2))
        if t.row_parallel:  # x held this rank's in-features only: h is a partial sum
            dist.all_reduce(h, group=self._tp_group)
        if self._uniform is not None:
            d = torch.matmul(h, t.Bt[self._uniform, :r])
        else:
            d = torch.bmm(h, t.Bt[:, :r].index_select(0, idx))
        y = y + d.reshape(y.shape).to(y.dtype)
        if isinstance(out, DTensor):
            return DTensor.from_local(y, out.device_mesh, out.placements, run_check=False, shape=out.shape,
                                      stride=out.stride())
        return y


__all__ = ["LoraSlots", "TooManyAdapters"]
