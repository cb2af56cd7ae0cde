"""A worker's handlers of the commands that change what it serves: models added and removed while
serving (their builds run on ``shard_builder.BackgroundJobs``' thread), and LoRA adapters of its
causal LMs (``lora``: host copies read here, device slots taken by the steps that use them)."""
from __future__ import annotations

import logging
import time
import traceback
from functools import partial

from ..comm import messages as msg
from ..models.base import GenerativeRunner
from .shard_builder import held_format

log = logging.getLogger("computron.worker")


class ModelChanges:
    """Mixed into ``worker.Worker``: these handlers use its registries (``runners``, ``stores``,
    ``model_configs``, ``lora``), its builder and its channel."""

    def _on_add_model(self, cmd: msg.AddModel) -> None:
        mid, mc = cmd.model_id, cmd.config
        if mid in self.stores:
            raise ValueError(f"model {mid!r} is already served on rank {self.rank}")

        def build() -> None:  # on the build thread
            t0 = time.perf_counter()
            try:
                try:
                    built = self._builder.build(mid, mc, partial(self._reserve_host, mid), while_serving=True)
                except Exception as exc:  # noqa: BLE001 - reported; the rank keeps serving
                    log.warning("rank %d: building %s failed: %s\n%s", self.rank, mid, exc, traceback.format_exc())
                    self.channel.reply(self._failure(cmd.seq, mid, exc))
                    return
                with self._registry_lock:
                    self.runners = {**self.runners, mid: built.runner}
                    self.stores = {**self.stores, mid: built.store}
                    self.model_configs = {**self.model_configs, mid: mc}
            finally:
                self._settle_host(mid)
            self._log_built(mid, built, "while serving")
            runner = built.runner
            try:  # a reply the master waits for, whatever fails in making it
                reply = msg.ModelAdded(
                    seq=cmd.seq, rank=self.rank, model_id=mid, start=t0, end=time.perf_counter(),
                    host_bytes=built.store.nbytes, host_resident=self.host_resident(),
                    weight_format=held_format(runner, built.store),
                    device_need=max(getattr(built.store, "device_need", 0), built.store.nbytes),
                    batching=runner.batching_defaults() if isinstance(runner, GenerativeRunner) else None)
            except Exception as exc:  # noqa: BLE001 - reported; the model is not served here after all
                log.warning("rank %d: reporting %s failed: %s\n%s", self.rank, mid, exc, traceback.format_exc())
                with self._registry_lock:
                    self.runners = {m: r for m, r in self.runners.items() if m != mid}
                    self.stores = {m: st for m, st in self.stores.items() if m != mid}
                    self.model_configs = {m: c for m, c in self.model_configs.items() if m != mid}
                reply = self._failure(cmd.seq, mid, exc)
            self.channel.reply(reply)
        self._builds.submit(build)

    def _on_remove_model(self, cmd: msg.RemoveModel) -> None:
        t0 = time.perf_counter()
        mid = cmd.model_id
        with self._registry_lock:
            store = self.stores.get(mid)
            runner = self.runners.get(mid)
            self.runners = {m: r for m, r in self.runners.items() if m != mid}
            self.stores = {m: s for m, s in self.stores.items() if m != mid}
            self.model_configs = {m: c for m, c in self.model_configs.items() if m != mid}
        slots = self.lora.pop(mid, None)
        if slots is not None:
            for aid in list(slots.adapters()):
                slots.remove(aid)
        if store is not None:
            if isinstance(runner, GenerativeRunner):
                runner.drop_all()
            with self._host_lock:  # after this, a read ahead of the model gives its buffers back
                store.close()
                if self.host_pool is not None and self.config.host_budget is not None:
                    self.host_pool.trim(max(0, self.config.host_budget - self._host_used()))
            self.host_kept = self.host_kept - {mid}
            log.info("rank %d removed %s (%.1f MB shard) in %.1f ms", self.rank, mid, store.nbytes / 2**20,
                     (time.perf_counter() - t0) * 1e3)
        self.channel.reply(msg.ModelRemoved(
            seq=cmd.seq, rank=self.rank, model_id=mid, start=t0, end=time.perf_counter(),
            device_bytes=self.device_bytes(), host_bytes=sum(s.host_bytes() for s in self.stores.values()),
            host_resident=self.host_resident()))

    def _on_add_adapter(self, cmd: msg.AddAdapter) -> None:
        from ..lora.slots import LoraSlots
        from ..lora.weights import load_rank_adapter
        t0 = time.perf_counter()
        runner = self.runners.get(cmd.model_id)
        if not isinstance(runner, GenerativeRunner) or not hasattr(runner, "layer_ids"):
            raise TypeError(f"model {cmd.model_id!r} is not a causal LM this engine splits: it takes no adapter")
        slots = self.lora.get(cmd.model_id)
        if slots is None:
            slots = LoraSlots(runner, self.config.max_loras, self.config.max_lora_rank)
        slots.add(cmd.adapter_id, load_rank_adapter(cmd.info, runner, pin=self.device.type == "cuda"))
        self.lora[cmd.model_id] = runner.lora = slots
        self._reply_adapter(cmd, t0, slots)

    def _on_remove_adapter(self, cmd: msg.RemoveAdapter) -> None:
        t0 = time.perf_counter()
        slots = self.lora.get(cmd.model_id)
        if slots is not None and cmd.adapter_id in slots.adapters():
            slots.remove(cmd.adapter_id)
            runner = self.runners.get(cmd.model_id)
            if runner is not None:
                runner.forget_prefixes()
        self._reply_adapter(cmd, t0, slots)

    def _reply_adapter(self, cmd, t0: float, slots) -> None:
        self.channel.reply(msg.AdapterDone(
            seq=cmd.seq, rank=self.rank, model_id=cmd.model_id, start=t0, end=time.perf_counter(),
            adapter_id=cmd.adapter_id, host_bytes=slots.host_bytes() if slots is not None else 0,
            device_bytes=slots.device_bytes() if slots is not None else 0))
