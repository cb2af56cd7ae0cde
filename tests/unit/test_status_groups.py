"""`/health`, `/api/status` and `/metrics` of a server on engine groups, against a stub engine whose
snapshot is a ``ClusterSnapshot`` (two groups: group 0 serving, group 1 down after a restart), and the
same routes of a plain engine, which show no group. No process: FastAPI's in-process test client.
"""
import re

import pytest
from fastapi.testclient import TestClient
from serve_helpers import StubEngineBase

from computron.cluster.board import ClusterSnapshot, merge_model
from computron.engine import EngineSnapshot, ModelSnapshot
from computron.server import create_app
from computron.server.building import ServedModel
from computron.server.model_kind import ModelKind

MODELS = ("a", "b", "c")


def model(state, tier, **kw):
    return ModelSnapshot(state=state, tier=tier, waiting=kw.pop("waiting", 0), running=0, paused=0,
                         token_level=True, pinned=False, **kw)


def cluster_snapshot(g1_alive: bool, restarts: int) -> ClusterSnapshot:
    """Group 0 holds ``a`` and has ``b`` on host; group 1, when up, has ``a`` offloading and ``b`` loaded.
    ``c`` is reported by no group."""
    g0 = EngineSnapshot(True, None, {"a": model("loaded", "device", waiting=1), "b": model("offloaded", "host")})
    g1 = (EngineSnapshot(True, None, {"a": model("offloading", "device", waiting=2), "b": model("loaded", "device")})
          if g1_alive else EngineSnapshot(False, "worker 3 died"))
    per = {0: g0, 1: g1}
    models = {}
    for m in MODELS:
        here = {i: s.models[m] for i, s in per.items() if s.alive and m in s.models}
        if here:
            models[m] = merge_model(here)
    return ClusterSnapshot(alive=True, dead_reason=None, models=models, groups=per, restarts={0: 0, 1: restarts})


class ClusterStub(StubEngineBase):
    """The server's view of a ``ClusterEngine``: its snapshot is ``snap``."""

    def __init__(self, snap):
        super().__init__("a")
        self.snap = snap

    def snapshot(self):
        return self.snap

    async def stream(self, model_id, data, timeout=None):
        raise AssertionError("no request here")
        yield


class PlainStub(ClusterStub):
    def __init__(self):
        super().__init__(EngineSnapshot(True, None, {"a": model("loaded", "device"), "b": model("offloaded", "disk")}))


@pytest.fixture
def serve():
    clients = []

    def start(engine):
        models = {m: ServedModel(m, f"/nowhere/{m}", ModelKind.GENERATION) for m in MODELS}
        c = TestClient(create_app(engine, models=models))
        clients.append(c.__enter__())
        return c
    yield start
    for c in clients:
        c.__exit__(None, None, None)


def series(text, name):
    """``{labels: value}`` of one metric family in Prometheus' text format."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m:
            out[tuple(re.findall(r'="([^"]*)"', m.group(1) or ""))] = float(m.group(2))
    return out


def test_groups_in_health_status_and_metrics(serve):
    engine = ClusterStub(cluster_snapshot(g1_alive=True, restarts=0))
    c = serve(engine)
    up = [{"group": 0, "alive": True, "reason": None, "restarts": 0},
          {"group": 1, "alive": True, "reason": None, "restarts": 0}]
    r = c.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "groups": up}
    st = c.get("/api/status").json()
    assert st["groups"] == up
    rows = {row["id"]: row for row in st["models"]}
    # JSON keys are strings; residency names are the page's (resident, offloading, host, ...)
    assert rows["a"]["groups"] == {"0": "resident", "1": "offloading"} and rows["a"]["state"] == "resident"
    assert rows["a"]["waiting"] == 3
    assert rows["b"]["groups"] == {"0": "host", "1": "resident"}
    assert rows["c"]["groups"] == {}  # served, but no group reports it
    text = c.get("/metrics").text
    assert series(text, "computron_group_alive") == {("0",): 1.0, ("1",): 1.0}
    assert series(text, "computron_group_restarts_total") == {("0",): 0.0, ("1",): 0.0}
    assert series(text, "computron_group_model_state") == {
        ("0", "a", "resident"): 1.0, ("0", "b", "host"): 1.0, ("1", "a", "offloading"): 1.0,
        ("1", "b", "resident"): 1.0}
    assert "# TYPE computron_group_restarts_total counter" in text

    # group 1 is restarted by Ray, then down again: the other group serves on
    engine.snap = cluster_snapshot(g1_alive=False, restarts=1)
    down = [up[0], {"group": 1, "alive": False, "reason": "worker 3 died", "restarts": 1}]
    r = c.get("/health")
    assert r.status_code == 200 and r.json()["groups"] == down
    st = c.get("/api/status").json()
    assert st["groups"] == down
    assert {row["id"]: row["groups"] for row in st["models"]} == {"a": {"0": "resident"}, "b": {"0": "host"}, "c": {}}
    text = c.get("/metrics").text
    assert series(text, "computron_group_alive") == {("0",): 1.0, ("1",): 0.0}
    assert series(text, "computron_group_restarts_total") == {("0",): 0.0, ("1",): 1.0}
    assert series(text, "computron_group_model_state") == {("0", "a", "resident"): 1.0, ("0", "b", "host"): 1.0}

    # every group down: 503, with each group's why
    engine.dead = "every engine group is down"
    r = c.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "dead" and r.json()["groups"] == down
    c.app.state.computron.draining = True
    r = c.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "shutting_down", "groups": down}


def test_plain_engine_shows_no_group(serve):
    engine = PlainStub()
    c = serve(engine)
    assert c.get("/health").json() == {"status": "ok"}
    st = c.get("/api/status").json()
    assert "groups" not in st and all(row["groups"] is None for row in st["models"])
    assert [row["state"] for row in st["models"]] == ["resident", "disk", "host"]
    assert "computron_group" not in c.get("/metrics").text
    engine.dead = "engine is dead: worker 1 exited"
    r = c.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "dead", "reason": "engine is dead: worker 1 exited"}
    c.app.state.computron.draining = True
    r = c.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "shutting_down"}
