"""The front's view of its groups' liveness, with fake groups (no Ray cluster): the keepalive takes a silent
group out of routing and brings it back when it answers; every death is logged once, as
``engine group N is down: CAUSE``, whoever noticed it (a request, the keepalive, the push stream)."""
import asyncio
import logging
import threading
import types

import pytest

pytest.importorskip("ray", reason="Ray is not installed: the cluster front needs it")

from computron.cluster.board import GroupDied  # noqa: E402
from computron.cluster.front import ClusterEngine  # noqa: E402
from computron.cluster.groups import GroupUpdate  # noqa: E402
from computron.cluster.keepalive import KeepaliveConfig  # noqa: E402
from computron.cluster.policy import GroupState, SwapAwareRouter  # noqa: E402
from computron.engine.protocol import EngineSnapshot  # noqa: E402
from computron.errors import EngineDeadError  # noqa: E402

MODELS = frozenset({"a", "b"})
CATALOG = [types.SimpleNamespace(model_id=m) for m in sorted(MODELS)]  # what the front reads of a ModelConfig


def update(g, incarnation="inc0"):
    return GroupUpdate(GroupState(g, served=MODELS, load_s={"a": 0.5, "b": 0.5}), EngineSnapshot(True, None),
                       {}, [], incarnation)


class Call:
    """``handle.method`` of a fake actor: ``remote(...)`` gives what ``fn`` returns."""

    def __init__(self, fn):
        self.remote = fn


class PushStream:
    """What ``group.watch.remote()`` returns: an async iterator of awaitables (as Ray's generator is) that
    gives one update, then stays open until cancelled."""

    def __init__(self, first):
        self.first = first

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.first is None:
            await asyncio.get_running_loop().create_future()
        upd, self.first = self.first, None

        async def value():
            return upd
        return value()


class FakeGroup:
    """Pushes one update and then nothing (its stream stays open); answers pings while ``answering`` is set,
    else holds each ping until it is set."""

    def __init__(self, g):
        self.g = g
        self.answering = threading.Event()
        self.answering.set()
        self.watch = Call(self._watch)
        self.ping = Call(self._ping)

    def _watch(self):
        return PushStream(update(self.g))

    async def _ping(self):
        await asyncio.to_thread(self.answering.wait)
        return "inc0"


@pytest.fixture
def front(monkeypatch):
    import ray
    monkeypatch.setattr(ray, "cancel", lambda ref: None)  # the fake streams are no Ray generators
    groups = [FakeGroup(0), FakeGroup(1)]
    f = ClusterEngine(groups, SwapAwareRouter(2), CATALOG, keepalive=KeepaliveConfig(interval_s=0.01, timeout_s=0.05))
    f.close = lambda: None  # no Ray: stop the loop by hand below
    yield f, groups
    f._closed = True
    for g in groups:
        g.answering.set()
    asyncio.run_coroutine_threadsafe(f._stop_tasks(), f._loop).result(10)
    f._loop.call_soon_threadsafe(f._loop.stop)
    f._thread.join(10)


def events_of(front):
    seen = []
    cond = threading.Condition()

    def on(i, upd):
        with cond:
            seen.append((i, upd is not None))
            cond.notify_all()
    front.add_observer(on)

    def wait_for(item):
        """Wait for ``item`` among the events not waited for yet."""
        with cond:
            assert cond.wait_for(lambda: item in seen, timeout=30), f"never saw {item}: {seen}"
            del seen[:seen.index(item) + 1]
    return wait_for


def test_a_silent_group_gets_no_request_until_it_answers_again(front, caplog):
    f, groups = front
    wait_for = events_of(f)
    f.start(timeout_s=30)
    wait_for((1, True))  # its first push
    groups[1].answering.clear()  # group 1's node is cut off: its pings hang
    with caplog.at_level(logging.ERROR, logger="computron.cluster"):
        wait_for((1, False))
    assert not f.group_states()[1]["alive"] and "keepalive" in f.group_states()[1]["reason"]
    assert {f._route(m, 1, [], [])[0] for m in ("a", "b")} == {0}
    with pytest.raises(EngineDeadError, match="no engine group can serve model 'a'"):
        f._route("a", 1, [0], [])
    downs = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
    assert len(downs) == 1 and downs[0].startswith("engine group 1 is down: silent: no answer to the front's "
                                                   "keepalive within 0.05s")
    groups[1].answering.set()  # the link is back: its pending ping answers
    wait_for((1, True))
    assert f.group_states()[1]["alive"] and f._route("a", 1, [0], [])[0] == 1


def test_the_last_group_up_is_not_taken_out_for_silence(front, caplog):
    f, groups = front
    f.start(timeout_s=30)
    with f._lock:
        assert f._board.silence(0, "no answer") is not None  # group 1 is up: group 0 is taken out
        assert f._board.silence(1, "no answer") is None  # the last one up: kept (requests wait for it)
    assert [s["alive"] for s in f.group_states().values()] == [False, True]


@pytest.mark.parametrize("order", ["request first", "push stream first"])
def test_every_death_is_logged_once_however_it_was_noticed(order, caplog):
    f = ClusterEngine([FakeGroup(0), FakeGroup(1)], SwapAwareRouter(2), CATALOG,
                      keepalive=KeepaliveConfig(interval_s=0))
    try:
        for g in (0, 1):
            f._on_update(g, update(g))
        with caplog.at_level(logging.ERROR, logger="computron.cluster"):
            if order == "request first":
                f._suspect(1, "inc0", GroupDied(1, "worker rank 0 exited (exit code -9)"))
                f._on_death(1, RuntimeError("actor died"), permanent=False)
            else:
                f._on_death(1, RuntimeError("actor died"), permanent=False)
                f._suspect(1, "inc0", GroupDied(1, "worker rank 0 exited (exit code -9)"))
        downs = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
        cause = "worker rank 0 exited (exit code -9)" if order == "request first" else "RuntimeError: actor died"
        assert len(downs) == 1 and downs[0].startswith(f"engine group 1 is down: {cause} (noticed by ")
        assert not f.group_states()[1]["alive"]
    finally:
        f._loop.close()


def test_keepalive_settings_from_the_environment_and_their_errors():
    assert KeepaliveConfig.from_env({}) == KeepaliveConfig(1.0, 4.0)
    cfg = KeepaliveConfig.from_env({"COMPUTRON_GROUP_KEEPALIVE_S": "0.5", "COMPUTRON_GROUP_KEEPALIVE_TIMEOUT_S": "2"})
    assert cfg == KeepaliveConfig(0.5, 2.0) and cfg.enabled
    assert not KeepaliveConfig.from_env({"COMPUTRON_GROUP_KEEPALIVE_S": "0"}).enabled
    with pytest.raises(ValueError, match="COMPUTRON_GROUP_KEEPALIVE_TIMEOUT_S='soon'"):
        KeepaliveConfig.from_env({"COMPUTRON_GROUP_KEEPALIVE_TIMEOUT_S": "soon"})
    with pytest.raises(ValueError, match=r"KeepaliveConfig.timeout_s=-1"):
        KeepaliveConfig(1.0, -1)
