"""``computron serve``'s restarting engine (``server.restarts``) over stub engines: replays, the restarts' bound,
what carries over (milliseconds, no process)."""
import asyncio
import threading

import pytest

from computron.engine.protocol import EngineSnapshot
from computron.errors import EngineDeadError
from computron.server.restarts import RestartingEngine


class Stub:
    def __init__(self, name, tokens=(1, 2, 3, 4), die_after=None):
        self.name, self.tokens, self.die_after = name, list(tokens), die_after
        self.reason, self.closed = None, False
        self.stopped = threading.Event()
        self.pins, self.priorities = {}, {}

    @property
    def is_alive(self):
        return self.reason is None and not self.closed

    @property
    def dead_reason(self):
        return self.reason

    def die(self, why="worker rank 0 exited unexpectedly (exit code -9)"):
        self.reason = f"engine is dead: {why}"
        self.stopped.set()

    def run(self):
        self.stopped.wait()
        if self.reason is not None and not self.closed:
            raise EngineDeadError(self.reason)

    async def submit(self, model_id, data, timeout=None):
        if self.die_after == 0:
            self.die()
        if self.reason:
            raise EngineDeadError(self.reason)
        return (self.name, data)

    async def stream(self, model_id, data, timeout=None):
        for i, t in enumerate(self.tokens):
            if i == self.die_after:
                self.die()
            if self.reason:
                raise EngineDeadError(self.reason)
            yield t

    def snapshot(self):
        return EngineSnapshot(alive=self.is_alive, dead_reason=self.reason)

    def counters(self):
        return {"steps": {"m": 2}}

    def events(self, since=0):
        evs = [{"id": i, "kind": self.name} for i in (1, 2) if i > since]
        return 2, evs

    async def add_model(self, config):
        pass

    def set_pinned(self, m, p=True):
        self.pins[m] = p

    def set_priority(self, m, p):
        self.priorities[m] = p

    async def shutdown(self):
        self.closed = True
        self.stopped.set()


class Config:
    def __init__(self, model_id):
        self.model_id = model_id


def restarting(first, nexts, restarts=3):
    launched = []

    def launch(configs):
        launched.append([c.model_id for c in configs])
        nxt = nexts.pop(0)
        if isinstance(nxt, Exception):
            raise nxt
        return nxt
    return RestartingEngine(first, launch, [Config("m")], restarts, backoff_s=0.001, window_s=600.0), launched


async def _restarted(engine, n):
    async with engine._changed:
        await engine._changed.wait_for(lambda: engine.restarts >= n or engine._gave_up)


def test_a_request_in_flight_is_replayed_on_the_restarted_engine_with_state_carried_over():
    async def go():
        old, new = Stub("old", die_after=0), Stub("new")
        eng, launched = restarting(old, [new])
        eng.start()
        eng.set_pinned("m")
        eng.set_priority("m", 5)
        await eng.add_model(Config("m2"))
        assert await eng.submit("m", {"input_ids": [1]}) == ("new", {"input_ids": [1]})
        assert launched == [["m", "m2"]] and eng.restarts == 1 and eng.is_alive
        assert new.pins == {"m": True} and new.priorities == {"m": 5}
        assert eng.counters() == {"steps": {"m": 4}, "engine_restarts": {(): 1}}
        assert eng.events(0) == (4, [{"id": 3, "kind": "new"}, {"id": 4, "kind": "new"}])
        await eng.shutdown()
    asyncio.run(go())


def test_a_greedy_stream_goes_on_after_a_restart_and_others_end_naming_it():
    async def go():
        old, new, newer, newest = Stub("old", die_after=2), Stub("new"), Stub("newer"), Stub("newest")
        eng, _ = restarting(old, [new, newer, newest])
        eng.start()
        assert [t async for t in eng.stream("m", {"max_tokens": 4})] == [1, 2, 3, 4]  # greedy: replayed
        new.die_after = 2
        with pytest.raises(EngineDeadError, match=r"\(2 tokens sent\); the engine is restarting: the stream ends"):
            async for _ in eng.stream("m", {"temperature": 1.0}):  # sampled without a seed: not replayable
                pass
        await _restarted(eng, 2)
        newer.die_after = 1
        assert [t async for t in eng.stream("m", {"temperature": 1.0, "seed": 3})] == [1, 2, 3, 4]  # seeded
        assert eng.restarts == 3
        await eng.shutdown()
    asyncio.run(go())


def test_a_replay_that_differs_ends_the_stream():
    async def go():
        eng, _ = restarting(Stub("old", die_after=2), [Stub("new", tokens=(1, 9, 9, 9))])
        eng.start()
        got = []
        with pytest.raises(EngineDeadError, match="its replay differed at token 2: the stream ends here"):
            async for t in eng.stream("m", {"max_tokens": 4}):
                got.append(t)
        assert got == [1, 2]
        await eng.shutdown()
    asyncio.run(go())


def test_restarts_are_bounded_and_a_failed_one_counts():
    async def go():
        first, second = Stub("first"), Stub("second")
        eng, launched = restarting(first, [RuntimeError("no GPU"), second], restarts=2)
        eng.start()
        first.die()
        assert not eng.is_alive and eng.dead_reason.endswith(
            "; the engine is restarting (ServerSettings.engine_restarts=2)")
        await _restarted(eng, 1)
        assert eng.is_alive and len(launched) == 2  # the failed launch, then the good one
        second.die("worker rank 1 sent no heartbeat")
        await _restarted(eng, 2)
        assert not eng.is_alive
        assert eng.dead_reason == ("engine is dead: worker rank 1 sent no heartbeat; not restarted: 2 restarts "
                                   "within 600s already (ServerSettings.engine_restarts=2)")
        assert eng.snapshot() == EngineSnapshot(alive=False, dead_reason=eng.dead_reason)
        with pytest.raises(EngineDeadError, match="not restarted"):
            await eng.submit("m", {})
        await eng.shutdown()
    asyncio.run(go())
