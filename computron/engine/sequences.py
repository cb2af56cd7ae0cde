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
import dataclasses
import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

from ..batching.base import SubmitEntry
from ..comm.messages import SeqSpec
from ..errors import RequestTimeoutError
from .chunking import StepBudget
from .protocol import PromptLogprobs, TokenLogprob

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
    gen_state: Optional[bytes] = None
    """Sampling generator state of a sequence paused for recompute, handed back on resume."""
    preemptions: int = 0
    adapter: Optional[str] = None
    """The LoRA adapter its sequence runs with on its model's weights (None: the bare model)."""
    logprobs: List[Any] = field(default_factory=list)
    """What its stream got beyond the ids: ``PromptLogprobs`` and ``TokenLogprob`` items, for a request
    with ``logprobs`` or ``prompt_logprobs``."""

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting
            pass

    def push(self, tokens: List[int], logprobs: Optional[list] = None, prompt: Optional[tuple] = None) -> None:
        """New tokens of a running sequence, in order; with their ``logprobs`` (one ``(logprob, top)`` or
        None per token) and the prompt's scores (``prompt``: the workers' entries), for a request that
        asked for them: its stream then gets ``TokenLogprob`` items (a ``PromptLogprobs`` first)."""
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.tokens.extend(tokens)
        items: list = list(tokens)
        spec = self.spec
        if spec is not None and (spec.logprobs is not None or spec.prompt_logprobs is not None):
            items = []
            if prompt is not None:
                items.append(PromptLogprobs(tuple(None if e is None else TokenLogprob(e[0], e[1], tuple(e[2]))
                                                  for e in prompt)))
            for i, t in enumerate(tokens):
                lp = logprobs[i] if logprobs else None
                items.append(TokenLogprob(t, lp[0], tuple(lp[1])) if lp is not None
                             else TokenLogprob(t, float("nan")))
            self.logprobs.extend(items)
        if self.stream is not None:
            self._call(self.stream.put_nowait, items)

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


async def consume(queue: asyncio.Queue, timeout: Optional[float], what: str):
    """Yield the token lists a request's stream queue receives until its END; raise the error it
    receives instead, or RequestTimeoutError naming ``what`` past ``timeout`` seconds in all."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        if deadline is None:
            item = await queue.get()
        else:
            try:
                item = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise RequestTimeoutError(f"{what} took over {timeout}s") from None
        if item is END:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


class Cancelled(enum.Enum):
    """Where a cancelled sequence was."""
    ON_WORKERS = "on_workers"
    """Running: the workers hold its KV cache."""
    PAUSED = "paused"
    """Waiting to be recomputed: nothing of it is on the workers."""


class TokenBatch:
    """One model's sequences under token-level generation, as the master sees them."""

    def __init__(self, batch_manager, max_batch_size: int, max_step_tokens: int, max_adapters: int = 1 << 30,
                 chunked: bool = False):
        self.bm = batch_manager
        self.chunked = chunked
        """Chunked prefill (paged KV): a prompt over what is left of the step's budget is prefilled in chunks
        over several steps (``chunking``) instead of waiting or going whole."""
        self.filling: Dict[int, Tuple[int, int]] = {}
        """Running sequences part-way through their prompt: sid -> (prompt tokens sent so far, prompt length),
        oldest first."""
        self.fill: Tuple[Tuple[int, int], ...] = ()
        """The chunks of ``filling`` sequences that the step ``next_step`` chose continues (``Step.fill``)."""
        self.step_tokens = 0
        """Prompt tokens the step ``next_step`` chose prefills."""
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens
        self.max_adapters = max_adapters
        """Distinct LoRA adapters one step may use (the workers' device slots per model)."""
        self.running: Dict[int, Request] = {}
        """sid (= request uid) -> request, for every sequence the workers hold."""
        self.to_drop: set = set()
        """Sequences the workers still hold but nobody waits for (cancelled, timed out)."""
        self.to_recompute: Deque[Request] = deque()
        """Paused sequences whose KV cache was dropped: re-admitted first, as prompt + generated tokens."""
        self.paused_since: Optional[float] = None
        """When the model was last preempted (its running sequences parked), None while it runs."""
        self.last_step: frozenset = frozenset()
        """The sequences the step ``next_step`` chose last brings a token for (those not mid-prefill)."""

    @property
    def live(self) -> bool:
        """Sequences exist on the workers, or wait to be recomputed: the model is mid-generation."""
        return bool(self.running or self.to_drop or self.to_recompute)

    def oldest(self) -> Optional[float]:
        return min((r.submitted for r in list(self.running.values()) + list(self.to_recompute)), default=None)

    def head(self, now: float) -> Optional[float]:
        """When this model's live sequences started waiting, for the scheduler: when they paused, the
        oldest one's arrival while they run, ``now`` for sequences only waiting to be dropped."""
        if not self.live:
            return None
        if self.paused_since is not None:
            return self.paused_since
        return self.oldest() if (self.running or self.to_recompute) else now

    def paused(self) -> int:
        return len(self.to_recompute) + (len(self.running) if self.paused_since else 0)

    def contexts(self) -> Dict[int, int]:
        """Tokens in each running sequence's KV cache (prompt + generated)."""
        return {sid: self.filling.get(sid, (len(r.spec.prompt) + len(r.tokens),))[0] for sid, r in self.running.items()}

    def on_step_done(self, sids, tokens, ended, logprobs=(), prompt_logprobs=None) -> List[Request]:
        """Hand each sequence its new token (and its logprobs, where asked); return those that ended,
        removed from the batch. A preemption decided while the step ran may already have moved some to
        the recompute list."""
        ended = set(ended)
        paused = {r.uid: r for r in self.to_recompute}
        prompt_logprobs = prompt_logprobs or {}
        done = []
        for i, (sid, token) in enumerate(zip(sids, tokens)):
            req = self.running.get(sid) or paused.get(sid)
            if req is None or sid in self.filling:
                continue  # cancelled while this step ran; the workers drop it next step
            req.push([token], [logprobs[i]] if logprobs else None, prompt_logprobs.get(sid))
            if sid in ended:
                if sid in self.running:
                    del self.running[sid]
                else:
                    self.to_recompute.remove(req)
                done.append(req)
        return done

    def restore_generators(self, states: Dict[int, bytes]) -> None:
        """Sampling states of sequences paused for recompute, as the output rank handed them back."""
        for req in self.to_recompute:
            if req.uid in states:
                req.gen_state = states[req.uid]

    def pause(self, recompute: List[int], now: float) -> None:
        """The model was preempted: ``recompute`` lose their KV cache, the others are parked with it."""
        for sid in recompute:
            req = self.running.pop(sid)
            self.filling.pop(sid, None)  # its prefill starts again when it is recomputed
            self.to_recompute.append(req)
        for req in list(self.running.values()) + list(self.to_recompute):
            req.preemptions += 1
        self.paused_since = now

    def resume_spec(self, req: Request) -> SeqSpec:
        """A paused sequence rebuilt by prefill: its prompt plus every token generated so far."""
        spec = req.spec
        return dataclasses.replace(spec, prompt=spec.prompt + tuple(req.tokens),
                                   max_tokens=spec.max_tokens - len(req.tokens), gen_state=req.gen_state,
                                   generated=spec.generated + len(req.tokens), chunk=0)

    def next_step(self, queue: Deque[SubmitEntry], requests: Dict[int, Request]) -> Tuple[list, tuple, list]:
        """Choose what the next step admits (oldest first, up to the batch size and the prompt-token
        budget; a longer prompt alone still goes, or, ``chunked``, a chunk of it) and drops; ``fill`` and
        ``step_tokens`` then say which sequences mid-prefill continue and how many prompt tokens run. Also
        returns ``[(uid, error)]`` for requests that cannot become a sequence (a batch manager that let a
        bad field through)."""
        admit, rejected, fill = [], [], []
        budget = StepBudget(self.max_step_tokens, len(self.running) - len(self.filling) if self.chunked else 0)
        now = time.perf_counter()
        self.paused_since = None
        for sid, (sent, length) in list(self.filling.items()):
            n = budget.grant(length - sent)
            if not n:
                break
            fill.append((sid, n))
            if sent + n < length:
                self.filling[sid] = (sent + n, length)
            else:
                del self.filling[sid]
        while self.to_recompute and len(self.running) < self.max_batch_size:
            spec = self.resume_spec(self.to_recompute[0])
            spec = self._join(spec, budget, resume=True)
            if spec is None:
                break
            req = self.to_recompute.popleft()
            self.running[spec.sid] = req
            admit.append(spec)
        adapters = {r.adapter for r in list(self.running.values()) + list(self.to_recompute)} - {None}
        while queue and len(self.running) < self.max_batch_size and not self.to_recompute:
            entry = queue[0]
            req = requests[entry.uid]
            if req.adapter is not None and req.adapter not in adapters and len(adapters) >= self.max_adapters:
                break  # the step's adapters fill the device slots: it joins once one of them is done
            try:
                spec = self.bm.to_spec(entry.uid, entry.data)
            except Exception as exc:  # noqa: BLE001 - that request fails alone
                queue.popleft()
                rejected.append((entry.uid, exc))
                continue
            if req.adapter is not None:
                spec = dataclasses.replace(spec, adapter=req.adapter)
            joining = self._join(spec, budget)
            if joining is None:
                break
            if req.adapter is not None:
                adapters.add(req.adapter)
            queue.popleft()
            req.spec, req.admitted = spec, now
            self.running[spec.sid] = req
            admit.append(joining)
        self.fill = tuple(fill)
        self.step_tokens = sum(n for _, n in fill) + sum(a.chunk or len(a.prompt) for a in admit)
        self.last_step = frozenset(self.running) - set(self.filling)
        return admit, self.take_drops(), rejected

    def wants_step_ahead(self, queue: Deque[SubmitEntry]) -> bool:
        """Whether a step sent now, behind the one in flight (the last ``next_step`` chose), has work: a
        sequence mid-prefill, one that ``max_tokens`` does not end with that step, or room for a waiting
        request. An EOS or stop string may still end them: that step then runs for nothing."""
        if self.paused_since is not None or self.to_recompute:
            return False
        if queue and len(self.running) < self.max_batch_size:
            return True
        return any(sid in self.filling or len(req.tokens) + (sid in self.last_step) < req.spec.max_tokens
                   for sid, req in self.running.items())

    def _join(self, spec: SeqSpec, budget: StepBudget, resume: bool = False) -> Optional[SeqSpec]:
        """``spec`` as it joins this step (a first chunk only, where chunked), or None: it waits. A recompute
        is never chunked: a model preempted every few steps would restart its chunks at every turn and never
        finish them, where a recompute's whole prefill runs in its turn's first step."""
        length = len(spec.prompt)
        if not self.chunked or resume:  # a recompute goes while any budget is left, a longer prompt alone
            if budget.prefills and (budget.left <= 0 if resume else length > budget.left):
                return None
            budget.left -= length
            budget.prefills += 1
            return spec
        n = budget.grant(length, chunkable=spec.prompt_logprobs is None)
        if not n:
            return None
        if n < length:
            self.filling[spec.sid] = (n, length)
            return dataclasses.replace(spec, chunk=n)
        return spec

    def take_drops(self) -> Tuple[int, ...]:
        drop = tuple(sorted(self.to_drop))
        self.to_drop.clear()
        return drop

    def cancel(self, uid: int) -> Optional["Cancelled"]:
        """Forget a sequence: where it was (``Cancelled``), or None if it is none of this batch's. One the
        workers still hold is dropped there at the next step (or by a Drop command while the model is away)."""
        if self.running.pop(uid, None) is not None:
            self.filling.pop(uid, None)
            self.to_drop.add(uid)
            return Cancelled.ON_WORKERS
        for req in self.to_recompute:
            if req.uid == uid:
                self.to_recompute.remove(req)
                return Cancelled.PAUSED
        return None

    def take_all(self) -> List[Request]:
        """Every running or paused sequence, removed (the model's step failed)."""
        out = list(self.running.values()) + list(self.to_recompute)
        self.running.clear()
        self.to_recompute.clear()
        self.filling.clear()
        return out

    def abandon(self) -> Tuple[List[Request], Tuple[int, ...]]:
        """Forget everything (the model cannot run on): the requests to fail, and the sequences the
        workers may still hold (to drop there)."""
        on_workers = tuple(sorted(set(self.running) | self.to_drop))
        victims = self.take_all()
        self.to_drop.clear()
        self.paused_since = None
        return victims, on_workers
