"""The engine sequences of one request: one ``engine.stream`` per choice (``n`` per prompt, every prompt of a
batch), all in flight together, each read by a task of its own into one queue.

``start`` waits until every choice has its first item (or has failed), so an error before the answer
begins (a bad field the engine refuses, a full queue) gets its status code; ``whole`` waits for every
choice; ``events`` yields ``(run, kind, piece)`` as the choices make them (``kind``: ``piece``, or ``end``
with the last piece). A client that goes away, or any way out, closes every sequence (``close``): the
engine drops them at its next step. Each choice's ``ChoiceRun`` holds what it made.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

import anyio
from fastapi import Request

from ..http import unless_disconnected
from ..state import Call, ServerState
from .choices import ChoiceRun, Piece


class Generation:
    def __init__(self, state: ServerState, request: Request, call: Call, model_id: str, runs: List[ChoiceRun]):
        self.state, self.request, self.call, self.model_id, self.runs = state, request, call, model_id, runs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.errors: Dict[int, BaseException] = {}
        self.early: Dict[int, BaseException] = {}
        """The errors of choices that failed before their first item (answered with their status code)."""
        self.ttft = -1.0
        self._first: List[asyncio.Event] = []
        self._tasks: List[asyncio.Task] = []

    async def _pump(self, run: ChoiceRun, first: asyncio.Event) -> None:
        self.call.arrived()  # the engine holds its place from the stream's first step on: no await between
        it = self.state.engine.stream(self.model_id, run.data, timeout=self.state.settings.request_timeout_s)
        try:
            async for item in it:
                piece = run.feed(item)
                if self.ttft < 0:
                    self.ttft = self.call.elapsed()
                first.set()
                if piece:
                    self.queue.put_nowait((run, "piece", piece))
                if run.done:
                    break
        except Exception as exc:  # noqa: BLE001 - reported to whoever reads the answer
            self.errors[run.index] = exc
            if not first.is_set():
                self.early[run.index] = exc
            self.queue.put_nowait((run, "error", exc))
            return
        finally:
            first.set()
            with anyio.CancelScope(shield=True):
                await it.aclose()
        self.queue.put_nowait((run, "end", run.finish()))

    def _launch(self, runs: List[ChoiceRun]) -> None:
        for run in runs:
            self._tasks.append(asyncio.ensure_future(self._pump(run, self._event())))

    def _event(self) -> asyncio.Event:
        self._first.append(asyncio.Event())
        return self._first[-1]

    @staticmethod
    def _raise_first(errors: Dict[int, BaseException]) -> None:
        if errors:
            raise errors[min(errors)]

    async def start(self) -> None:
        """Every choice under way, with its first item (or its end); an error before one of them raised (all
        closed). Errors after a first item come through ``events``."""
        self._launch(self.runs)
        try:
            await unless_disconnected(self.request, asyncio.gather(*(ev.wait() for ev in self._first)))
            self._raise_first(self.early)
        except BaseException:
            await self.close()
            raise

    async def _all(self) -> None:
        """The first choice read in this task (a lone request's engine errors surface at once, as they did
        before there were several), the others by tasks of their own."""
        first = self._event()
        self._launch(self.runs[1:])
        await self._pump(self.runs[0], first)
        await asyncio.gather(*self._tasks)

    async def whole(self) -> None:
        """Every choice to its end; the first error raised."""
        try:
            await unless_disconnected(self.request, self._all())
            self._raise_first(self.errors)
        finally:
            await self.close()

    async def events(self) -> AsyncIterator[Tuple[ChoiceRun, str, Piece]]:
        """The choices' pieces as they come (after ``start``), each choice's ``end`` last; an error raised."""
        ended = 0
        while ended < len(self.runs):
            run, kind, value = await self.queue.get()
            if kind == "error":
                raise value
            if kind == "end":
                ended += 1
            yield run, kind, value

    async def close(self) -> None:
        """Stop every sequence still running (cancelling its task closes its engine stream)."""
        for t in self._tasks:
            if not t.done():
                t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def counts(self, n: int) -> Tuple[int, int]:
        """(prompt tokens, generated tokens): each prompt counted once (its first choice's), every choice's
        tokens."""
        return (sum(r.n_prompt for r in self.runs if r.index % n == 0), sum(r.n_generated for r in self.runs))

    def done(self, n: int) -> Optional[Any]:
        """Count a 200 and the tokens in the metrics."""
        n_prompt, n_gen = self.counts(n)
        e2e = self.call.answered(f"{len(self.runs)} choices, {n_prompt}+{n_gen} tokens")
        self.state.metrics.tokens(self.call.label, n_prompt, n_gen)
        self.state.metrics.latency(self.call.label, self.ttft, e2e, n_gen)
        return None
