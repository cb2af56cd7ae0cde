"""``ClusterEngine.stream`` when its group dies mid-generation, with fake groups (no Ray cluster): a greedy or
seeded generation is replayed on another group, its tokens already yielded checked and not yielded again; an
unseeded sampled one, or a replay that differs, ends with ``EngineDeadError``."""
import asyncio

import pytest

pytest.importorskip("ray", reason="Ray is not installed: the cluster front needs it")

from computron.cluster.front import ClusterEngine  # noqa: E402
from computron.cluster.groups import replayable  # noqa: E402
from computron.errors import EngineDeadError  # noqa: E402

DIES = object()


class FakeStream:
    """What ``group.stream.remote(...)`` returns: an async iterator of awaitables, as Ray's generator is."""

    def __init__(self, items):
        self.items = list(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)

        async def value():
            if item is DIES:
                raise EngineDeadError("worker rank 0 exited (exit code -9)")
            return item
        return value()


class FakeGroup:
    def __init__(self, items):
        self.items, self.calls = items, []
        self.stream = self

    def remote(self, model_id, data, timeout):
        self.calls.append((model_id, dict(data)))
        self.gen = FakeStream(self.items)
        return self.gen


class FirstAliveRouter:
    def route(self, model_id, tokens, now, exclude):
        return next(i for i in range(2) if i not in exclude)

    def finished(self, g, model_id, tokens):
        pass

    def update(self, state):
        pass


def run(items0, items1, data, monkeypatch):
    import ray
    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)
    groups = [FakeGroup(items0), FakeGroup(items1)]
    front = ClusterEngine(groups, FirstAliveRouter())
    got = []

    async def consume():
        async for tok in front.stream("m", data):
            got.append(tok)
    try:
        asyncio.run(consume())
        error = None
    except EngineDeadError as exc:
        error = str(exc)
    finally:
        front._loop.close()  # the front's own loop, which only start() runs
    return got, error, front, groups, cancelled


GREEDY = {"input_ids": [2, 5], "max_tokens": 5}


def test_replayable():
    assert replayable(GREEDY) and replayable({**GREEDY, "temperature": 0})
    assert replayable({**GREEDY, "temperature": 0.8, "seed": 3})
    assert replayable({**GREEDY, "temperature": 1, "top_k": 1})
    assert not replayable({**GREEDY, "temperature": 0.8}) and not replayable([1, 2])


@pytest.mark.parametrize("data", [GREEDY, {**GREEDY, "temperature": 0.7, "seed": 11}])
def test_a_replayable_generation_continues_on_another_group(data, monkeypatch):
    got, error, front, groups, cancelled = run([5, 6, 7, DIES], [5, 6, 7, 8, 9], data, monkeypatch)
    assert error is None and got == [5, 6, 7, 8, 9]
    assert front.retries == 1 and groups[1].calls == [("m", data)] and not cancelled


def test_an_unseeded_sampled_generation_ends_where_its_group_died(monkeypatch):
    got, error, front, groups, _ = run([5, 6, DIES], [5, 6, 7, 8, 9], {**GREEDY, "temperature": 0.7}, monkeypatch)
    assert got == [5, 6] and "(2 tokens sent): the stream ends here" in error and "exit code -9" in error
    assert front.retries == 0 and not groups[1].calls


@pytest.mark.parametrize("replay, at", [([5, 99, 7, 8, 9], 2), ([5], 2)], ids=["differs", "ends-early"])
def test_a_replay_that_differs_ends_the_stream_and_is_cancelled(replay, at, monkeypatch):
    got, error, _, groups, cancelled = run([5, 6, DIES], replay, GREEDY, monkeypatch)
    assert got == [5, 6] and f"differed at token {at}: the stream ends here" in error
    assert cancelled == ([groups[1].gen] if at <= len(replay) else [])


def test_a_second_death_ends_the_request(monkeypatch):
    got, error, front, _, _ = run([5, DIES], [5, 6, DIES], GREEDY, monkeypatch)
    assert got == [5, 6] and "failed twice" in error and front.retries == 2
