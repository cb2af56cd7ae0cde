"""Token-level generation on the master: each model's running batch, one step at a time.

``TokenLevel`` owns every ``TokenBatch`` (the master's view of a model's
sequences, ``sequences.py``) and every change made to one: which sequences a
step admits and drops, the tokens a step brings back, pausing sequences when
their model is preempted (their KV caches parked in host memory or dropped for
recompute, whichever ``choose_recompute`` estimates is cheaper), cancelling one,
and cleaning up after a failed step or load. Steps and cleanups go out through
the command tracker; answers go back through the request table.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional

import torch

from ..batching.causal_lm import CausalLMBatchManager
from ..comm import messages as msg
from ..config import EngineConfig
from ..errors import PayloadError, WorkerError
from ..metrics import KVRecord, PreemptionRecord, StepRecord
from ..sched.policies import choose_recompute, prefill_apart
from ..sched.scheduler import Scheduler
from ..sched.step_ahead import StepAhead
from .commands import CommandKind, CommandTracker, PendingCommand
from .requests import RequestTable
from .sequences import Cancelled, Request, TokenBatch
from .telemetry import Telemetry
from .wake import WakeAt

log = logging.getLogger("computron.engine")

DEFAULT_COPY_BYTES_PER_S = 1e10
"""Host-device copy rate assumed for a model never loaded yet (its first load measures the real one)."""
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
"""Prefill rate assumed for a model that has not admitted a sequence yet."""


class TokenLevel:
    def __init__(self, config: EngineConfig, requests: RequestTable, tracker: CommandTracker,
                 telemetry: Telemetry, scheduler: Scheduler, n_workers: int, device: str,
                 pump: Callable[[], None]):
        """``pump``: the engine's, run (under its lock) when a step is due to go ahead."""
        self.batches: Dict[str, TokenBatch] = {}
        self._config = config
        self._requests = requests
        self._tracker = tracker
        self._telemetry = telemetry
        self._sched = scheduler
        self._kv_swap = config.kv_swap
        self._n_workers = n_workers
        self._device_type = device.split(":")[0]
        lead = config.step_ahead_lead_ms
        self._ahead = StepAhead(None if lead is None else lead / 1e3)
        self._ahead_due = WakeAt(pump, "computron-step-ahead")

    def adopt(self, model_id: str, bm, batching: Optional[msg.BatchingDefaults]) -> bool:
        """Give ``model_id`` a running batch where it generates token by token (a causal LM whose workers
        gave its batching defaults, step mode on, not paper mode); False: it runs whole batches."""
        c = self._config
        if not (c.step_mode and not c.paper_mode and isinstance(bm, CausalLMBatchManager) and batching is not None):
            return False
        self.batches[model_id] = TokenBatch(bm, bm.max_batch_size, c.max_step_tokens, c.max_loras,
                                            chunked=c.kv_cache == "paged")
        return True

    def remove_model(self, model_id: str) -> None:
        self.batches.pop(model_id, None)
        self._ahead.forget(model_id)

    def __contains__(self, model_id: str) -> bool:
        return model_id in self.batches

    def live_models(self) -> List[str]:
        return [m for m, tb in self.batches.items() if tb.live]

    def ahead(self, now: float) -> List[str]:
        """Models whose next step may go out now, behind their one step in flight (``EngineConfig.step_ahead``,
        ``sched/step_ahead.py``); the engine is pumped again when the next other one may."""
        ready, wake = [], None
        for m, tb in self.batches.items() if self._config.step_ahead else ():
            if not tb.running or self._sched.in_flight(m) != 1 or not tb.wants_step_ahead(self._requests.queues[m]):
                continue
            due = self._ahead.due(m)
            if due is not None and due <= now:
                ready.append(m)
            elif due is not None:
                wake = due if wake is None else min(wake, due)
        if wake is not None:
            self._ahead_due.at(wake)
        return ready

    def stop_ahead(self) -> None:
        self._ahead_due.stop()

    def head(self, model_id: str, now: float) -> Optional[float]:
        tb = self.batches.get(model_id)
        return tb.head(now) if tb is not None else None

    # ---- steps ---------------------------------------------------------------
    def dispatch_step(self, model_id: str) -> None:
        t0 = time.perf_counter()
        tb = self.batches[model_id]
        admit, drop, rejected = tb.next_step(self._requests.queues[model_id], self._requests.requests)
        for uid, exc in rejected:
            self._requests.finish(uid, error=PayloadError(
                f"model {model_id!r}: malformed request: {type(exc).__name__}: {exc}",
                getattr(exc, "param", None), str(exc)))
        apart = prefill_apart(len(tb.running) - len(admit), [len(a.prompt) for a in admit],
                              self._sched.sizes.get(model_id, 0), self._device_type)
        ahead = self._sched.in_flight(model_id) > 1  # the scheduler counts this one already
        pending = self._tracker.send(
            CommandKind.STEP, model_id,
            lambda seq: msg.Step(seq, model_id, admit=tuple(admit), drop=drop, prefill_apart=apart, fill=tb.fill,
                                 ahead=ahead),
            start=t0, uids=tuple(tb.running), admitted=len(admit), dropped=len(drop),
            prompt_tokens=tb.step_tokens)
        pending.master_s = time.perf_counter() - t0
        self._ahead.sent(model_id, t0, tb.step_tokens)

    def complete_step(self, p: PendingCommand, now: float, error: Optional[str]) -> None:
        m = p.model_id
        tb = self.batches[m]
        self._sched.on_batch_done(m)
        start = self._ahead.start(m, p.start)
        if error is None:
            self._ahead.answered(m, p.start, now, max((b - a for a, b in p.rank_times().values()), default=0.0),
                                 p.prompt_tokens)
        done = p.of_type(msg.StepDone)
        out = next((x for x in done if x.sids), None)
        self._telemetry.counters["steps"][m] += 1
        if error is not None:
            log.error("a step of %s failed: %s", m, error)
            victims = tb.take_all()
            for req in victims:
                self._requests.finish(req.uid, error=WorkerError(f"model {m!r}: {error}"), batch_seq=p.seq)
            # some ranks kept sequences the others dropped, or a step sent ahead admits some: realign
            if any(x.running for x in done) or self._sched.in_flight(m):
                stale = tuple(sorted({r.uid for r in victims} | set(p.uids)))
                self._cleanup(m, lambda seq: msg.Step(seq, m, drop=stale))
        elif out is not None:
            self._telemetry.counters["tokens"][m] += len(out.sids)
            self._telemetry.kv_bytes[m] = out.kv_bytes
            for req in tb.on_step_done(out.sids, out.tokens, out.ended, out.logprobs, out.prompt_logprobs):
                self._requests.finish(req.uid, torch.tensor(req.tokens, dtype=torch.int64), batch_seq=p.seq)
        restored = sum(x.kv_restored_bytes for x in done)
        if restored:
            self._telemetry.record(KVRecord("kv_restore", m, start, now, restored,
                                            {x.rank: (x.start, x.start + x.kv_restore_s) for x in done},
                                            wall_start=self._telemetry.wall(start)))
        if error is None and p.prompt_tokens and now > start:
            self._telemetry.prefill_done(m, p.prompt_tokens, now - start)
        self._telemetry.record(StepRecord(
            m, start, now, running=len(out.sids) if out else 0, admitted=p.admitted, dropped=p.dropped,
            rank_times=p.rank_times(), error=error, seq=p.seq, kv_bytes=out.kv_bytes if out else 0,
            master_s=p.master_s + (time.perf_counter() - now), wall_start=self._telemetry.wall(start),
            prefill_tokens=out.prefill_tokens if out else 0))

    # ---- preemption ----------------------------------------------------------
    def preempt(self, model_id: str, target: str, policy: str, now: float) -> tuple:
        """Pause a model's sequences for ``target``; return those whose KV cache is dropped (recomputed)."""
        tb = self.batches[model_id]
        contexts = tb.contexts()
        if self._kv_swap == "offload":
            recompute = ()
        elif self._kv_swap == "recompute":
            recompute = tuple(sorted(contexts))
        else:
            recompute = tuple(sorted(choose_recompute(contexts, **self._kv_costs(model_id, contexts))))
        tb.pause(list(recompute), now)
        self._telemetry.counters["preemptions"][model_id] += 1
        self._telemetry.record(PreemptionRecord(model_id, now, target, parked=len(tb.running),
                                                recomputed=len(recompute), wall_start=self._telemetry.wall(now)))
        log.info("preempting %s for %s (%s policy): %d sequences parked with their KV cache, %d to recompute",
                 model_id, target, policy, len(tb.running), len(recompute))
        return recompute

    def _kv_costs(self, model_id: str, contexts: Dict[int, int]) -> Dict[str, float]:
        """What moving a KV cache and recomputing it cost here, from this model's own records."""
        tokens = sum(contexts.values())
        kv = self._telemetry.kv_bytes.get(model_id, 0)
        load = self._telemetry.last_swap[model_id].get("load")
        copy_bps = (load["bytes"] / max(load["seconds"], 1e-9) / self._n_workers if load
                    else DEFAULT_COPY_BYTES_PER_S)
        return {"kv_bytes_per_token": kv / tokens if kv and tokens else 0.0, "copy_bytes_per_s": copy_bps,
                "prefill_tokens_per_s": self._telemetry.prefill_rate.get(model_id, DEFAULT_PREFILL_TOKENS_PER_S)}

    def offloaded(self, p: PendingCommand, now: float) -> None:
        """The model left the devices: keep the sampling states of sequences paused for recompute and
        record the KV caches parked in host memory."""
        tb = self.batches.get(p.model_id)
        if tb is None or not (p.recompute or tb.running):
            return
        parked = p.of_type(msg.Offloaded)
        tb.restore_generators({sid: st for x in parked for sid, st in x.gen_states.items()})
        kv = sum(x.kv_parked_bytes for x in parked)
        if kv:
            self._telemetry.record(KVRecord("kv_offload", p.model_id, p.start, now, kv,
                                            {x.rank: (x.end - x.kv_park_s, x.end) for x in parked},
                                            wall_start=self._telemetry.wall(p.start)))

    # ---- leaving early -------------------------------------------------------
    def cancel(self, req: Request) -> bool:
        """Forget a cancelled request's sequence; False if it is not one (it still waits in its queue)."""
        tb = self.batches.get(req.model_id)
        where = tb.cancel(req.uid) if tb is not None else None
        if where is None:
            return False
        if where is Cancelled.ON_WORKERS and not self._sched.can_accept_batches(req.model_id):
            # the model is away (or leaving) with this sequence parked: no step will come soon
            tb.to_drop.discard(req.uid)
            self._cleanup(req.model_id, lambda seq: msg.Drop(seq, req.model_id, (req.uid,)))
        return True

    def load_failed(self, model_id: str, failure: BaseException) -> None:
        """Paused sequences cannot resume without their model: fail them, drop what the workers hold."""
        tb = self.batches.get(model_id)
        if tb is None or not tb.live:
            return
        victims, on_workers = tb.abandon()
        for req in victims:
            self._requests.finish(req.uid, error=failure)
        if on_workers:
            self._cleanup(model_id, lambda seq: msg.Drop(seq, model_id, on_workers))

    def forget_all(self) -> None:
        for tb in self.batches.values():
            tb.abandon()

    def _cleanup(self, model_id: str, make) -> None:
        self._tracker.send(CommandKind.CLEANUP, model_id, make)

