"""The master's side of each request, and of token-level generation per model.

``Request`` is one caller's request: its future, its stream queue (for
``Engine.stream``), its timings and, under token-level generation, the tokens
produced so far. ``TokenBatch`` is one model's token-level bookkeeping on the
master: which sequences run on the workers, which must be dropped at the next
step, and how the next step's admissions are chosen. No torch here beyond
turning a finished answer into a tensor; no locks (the engine holds its own).
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

from .batch import SubmitEntry
from .messages import SeqSpec

END = object()
"""Put on a stream's queue after its last tokens."""


@dataclass
class Request:
    uid: int
    model_id: str
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float
    """perf_counter at submit."""
    submitted_wall: float
    stream: Optional[asyncio.Queue] = None
    """Receives lists of new token ids, then END or an exception (Engine.stream)."""
    spec: Optional[SeqSpec] = None
    """Set when the request joins a running batch (token-level generation)."""
    tokens: List[int] = field(default_factory=list)
    admitted: Optional[float] = None
    first_token: Optional[float] = None

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting
            pass

    def push(self, tokens: List[int]) -> None:
        """New tokens of a running sequence, in order."""
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.tokens.extend(tokens)
        if self.stream is not None:
            self._call(self.stream.put_nowait, list(tokens))

    def resolve(self, value: Any = None, error: Optional[BaseException] = None) -> None:
        """Complete the future (and the stream) from any thread."""
        def done(f=self.future):
            if not f.done():
                if error is not None:
                    f.set_exception(error)
                else:
                    f.set_result(value)
        self._call(done)
        if self.stream is not None:
            if error is None and self.spec is None and value is not None:
                # request-level answer: the whole output arrives at once
                out = value.tolist() if hasattr(value, "tolist") else value
                if isinstance(out, list):
                    self._call(self.stream.put_nowait, out)
            self._call(self.stream.put_nowait, END if error is None else error)


class TokenBatch:
    """One model's sequences under token-level generation, as the master sees them."""

    def __init__(self, batch_manager, max_batch_size: int, max_step_tokens: int):
        self.bm = batch_manager
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.running: Dict[int, Request] = {}
        """sid (= request uid) -> request, for every sequence the workers hold."""
        self.to_drop: set = set()
        """Sequences the workers still hold but nobody waits for (cancelled, timed out)."""
        self.step_admitted: Tuple[int, ...] = ()

    def has_work(self, queue: Deque[SubmitEntry]) -> bool:
        return bool(self.running or self.to_drop or queue)

    def oldest(self) -> Optional[float]:
        return min((r.submitted for r in self.running.values()), default=None)

    def spec_for(self, uid: int, data: Dict[str, Any]) -> SeqSpec:
        """A request's sequence as the workers need it; the batch manager validated ``data`` at submit."""
        ids = _as_list(data["input_ids"])
        if "attention_mask" in data:  # masked-out tokens are invisible to the model: leave them out
            mask = _as_list(data["attention_mask"])
            ids = [t for t, m in zip(ids, mask) if m]
        temperature = float(data.get("temperature") or 0.0)
        seed = data.get("seed")
        if seed is None:
            seed = random.getrandbits(63) if temperature > 0 else 0
        eos = self.bm.eos_token_id or ()
        return SeqSpec(sid=uid, prompt=tuple(ids),
                       max_tokens=int(data.get("max_tokens", self.bm.default_max_tokens)),
                       eos=tuple(eos), temperature=temperature, top_k=int(data.get("top_k") or 0),
                       top_p=float(data["top_p"]) if data.get("top_p") is not None else 1.0, seed=int(seed))

    def next_step(self, queue: Deque[SubmitEntry], requests: Dict[int, Request]) -> Tuple[list, tuple, list]:
        """Choose what the next step admits (oldest first, up to the batch size and the prompt-token
        budget; a longer prompt alone still goes) and drops. Also returns ``[(uid, error)]`` for
        requests that cannot become a sequence (a batch manager that let a bad field through)."""
        admit, rejected, budget = [], [], self.max_step_tokens
        now = time.perf_counter()
        while queue and len(self.running) + len(admit) < self.max_batch_size:
            entry = queue[0]
            req = requests[entry.uid]
            try:
                spec = self.spec_for(entry.uid, entry.data)
            except Exception as exc:  # noqa: BLE001 - that request fails alone
                queue.popleft()
                rejected.append((entry.uid, exc))
                continue
            if admit and len(spec.prompt) > budget:
                break
            queue.popleft()
            budget -= len(spec.prompt)
            req.spec, req.admitted = spec, now
            self.running[spec.sid] = req
            admit.append(spec)
        drop = tuple(sorted(self.to_drop))
        self.to_drop.clear()
        self.step_admitted = tuple(s.sid for s in admit)
        return admit, drop, rejected

    def cancel(self, uid: int) -> bool:
        """Forget a running sequence; the workers drop it at the next step. True if it was running."""
        if self.running.pop(uid, None) is None:
            return False
        self.to_drop.add(uid)
        return True

    def take_all(self) -> List[Request]:
        """Every running sequence, removed (the model's step failed)."""
        out = list(self.running.values())
        self.running.clear()
        return out


def _as_list(v) -> List[int]:
    if hasattr(v, "tolist"):
        v = v.tolist()
        if v and isinstance(v[0], list):
            v = v[0]
    return list(v)
