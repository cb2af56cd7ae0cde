"""keep_alive: parsing what users write, the residency policy (``sched/keep_alive.py``), the scheduler's
release of an idle model, the engine offloading over fake workers, and ``computron ps``'s table."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fake_workers, whatever the import mode

from fake_workers import build_engine  # noqa: E402

from computron.comm import messages as msg  # noqa: E402
from computron.config import EngineConfig, ModelConfig  # noqa: E402
from computron.sched.keep_alive import FOREVER, KeepAliveError, KeepAlives, describe, parse_keep_alive  # noqa: E402
from computron.sched.scheduler import ActionKind, ModelState, Reason, Scheduler  # noqa: E402
from computron.server.ps_cli import human_bytes, table  # noqa: E402

WAIT_S = 5.0


@pytest.mark.parametrize("value,seconds", [
    ("5m", 300.0), ("30s", 30.0), ("1h30m", 5400.0), ("250ms", 0.25), ("1.5h", 5400.0), (" 2m ", 120.0),
    ("0", 0.0), (0, 0.0), ("0s", 0.0), (300, 300.0), ("300", 300.0), (2.5, 2.5),
    (-1, FOREVER), ("-1", FOREVER), ("-5m", FOREVER), (-0.5, FOREVER)])
def test_parse_keep_alive_reads_durations_seconds_zero_and_forever(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["5x", "", "m", "5 m", "five minutes", "1h-30m", True, None, [5], {"s": 1},
                                   float("nan"), float("inf"), "inf"])
def test_parse_keep_alive_refuses_anything_else_naming_the_field(value):
    with pytest.raises(KeepAliveError, match=r"^models\[0\]\.keep_alive=.*must be a duration like '5m'") as info:
        parse_keep_alive(value, "models[0].keep_alive")
    assert info.value.param == "models[0].keep_alive"


def test_describe_says_it_as_people_write_it():
    assert [describe(s) for s in (FOREVER, 0, 30, 300, 5400, 3661)] == ["forever", "0s", "30s", "5m", "1h30m",
                                                                         "1h1m1s"]


def test_configs_read_keep_alive_into_seconds():
    assert EngineConfig().keep_alive == FOREVER
    assert EngineConfig(keep_alive="5m").keep_alive == 300.0
    assert ModelConfig("a", print, keep_alive="30s").keep_alive == 30.0
    assert ModelConfig("a", print).keep_alive is None
    with pytest.raises(ValueError, match=r"EngineConfig\.keep_alive='soon'"):
        EngineConfig(keep_alive="soon")
    with pytest.raises(ValueError, match=r"ModelConfig\.keep_alive=True"):
        ModelConfig("a", print, keep_alive=True)


def test_a_request_keep_alive_overrides_the_models_which_overrides_the_engines():
    own = {"b": 60.0}
    k = KeepAlives(default_s=FOREVER, own=own.get)
    assert (k.keep_s("a"), k.keep_s("b")) == (FOREVER, 60.0)
    assert k.until("b") is None  # never used: nothing to count from
    k.done("b", 100.0)
    assert k.until("b") == 160.0
    k.requested("b", 0.0)  # the latest request's word
    assert k.until("b") == 100.0
    assert k.expired(["a", "b"], 100.0) == ["b"]
    k.requested("b", None)  # a request without one: the model's own again
    assert k.expired(["b"], 159.0) == [] and k.expired(["b"], 160.0) == ["b"]
    k.done("a", 100.0)
    assert k.until("a") is None and k.expired(["a"], 1e9) == []  # kept while memory allows
    k.requested("a", FOREVER)
    assert k.keep_s("a") == FOREVER
    k.remove("b")
    assert k.last_done("b") is None


def test_the_scheduler_releases_only_a_loaded_idle_unpinned_model():
    s = Scheduler(["a", "b"], max_loaded=2, pinned=["b"])
    for m in ("a", "b"):
        assert [x.kind for x in s.decide({m: 0.0})] == [ActionKind.LOAD]
        s.on_loaded(m)
    assert s.release("b") is None  # pinned
    assert [x.kind for x in s.decide({"a": 1.0})] == [ActionKind.RUN]
    assert s.release("a") is None  # a batch in flight
    s.on_batch_done("a")
    a = s.release("a")
    assert (a.kind, a.model_id, a.reason) == (ActionKind.OFFLOAD, "a", Reason.KEEP_ALIVE)
    assert s.state("a") is ModelState.OFFLOADING
    assert s.release("a") is None  # already leaving
    s.on_offloaded("a")
    assert s.release("a") is None  # offloaded


def _gen():
    return {"input_ids": [5, 6, 7], "max_tokens": 2}


async def _served(engine, w, model_id="a"):
    task = asyncio.ensure_future(engine.submit(model_id, _gen()))
    while not task.done():
        w.answer_all()
        await asyncio.sleep(0)  # a yield point: the answer reaches the task
    return task.result()


def test_keep_alive_zero_offloads_once_the_requests_are_done_and_forever_keeps():
    async def main():
        engine, w = build_engine(("a", "b"), max_loaded=2, overlap=False)
        engine.note_keep_alive("a", 0.0)
        await _served(engine, w, "a")
        await _served(engine, w, "b")  # the engine's default: kept
        w.answer_all()
        offloads = w.channel.of_type(msg.Offload)
        assert [o.model_id for o in offloads] == ["a"]
        assert engine.model_states() == {"a": "offloaded", "b": "loaded"}
        snap = engine.snapshot().models
        assert snap["a"].keep_alive_s == 0.0 and snap["a"].keep_until is None and snap["a"].device_bytes == 0
        assert snap["b"].keep_alive_s == FOREVER and snap["b"].keep_until is None
        assert snap["b"].device_bytes > 0 and snap["b"].last_used is not None
        rec = [r for r in engine.metrics("offload") if r.model_id == "a"]
        assert rec and rec[0].cause == "idle past its keep_alive"
        engine.close()
    asyncio.run(asyncio.wait_for(main(), 4 * WAIT_S))


def test_a_model_kept_for_a_while_shows_until_when_and_leaves_when_it_is_up():
    async def main():
        engine, w = build_engine([ModelConfig("a", print, keep_alive="10m")], overlap=False)
        await _served(engine, w, "a")
        w.answer_all()
        s = engine.snapshot().models["a"]
        assert s.state == "loaded" and s.keep_alive_s == 600.0
        assert s.keep_until == pytest.approx(s.last_used + 600.0)
        with engine._lock:
            engine._release_expired(engine._keep.until("a") - 1.0)  # the watchdog's question, before the time
        assert w.channel.of_type(msg.Offload) == []
        with engine._lock:
            engine._release_expired(engine._keep.until("a"))  # and at it
        w.answer_all()
        assert [o.model_id for o in w.channel.of_type(msg.Offload)] == ["a"]
        assert engine.model_states() == {"a": "offloaded"}
        engine.close()
    asyncio.run(asyncio.wait_for(main(), 4 * WAIT_S))


def test_ps_table_lines_up_the_columns():
    rows = [{"name": "opt-a", "state": "resident", "host_bytes": 1_310_720, "device_bytes": 1_441_792,
             "last_used": 990.0, "keep_alive": "5m", "keep_alive_s": 300.0, "expires_at": 1290.0},
            {"name": "opt-b", "state": "host", "host_bytes": 2_000, "device_bytes": 0, "last_used": None,
             "keep_alive": "forever", "keep_alive_s": -1.0, "expires_at": None},
            {"name": "sql", "base": "opt-a", "state": "resident", "host_bytes": 5, "device_bytes": 5,
             "last_used": 1000.0, "keep_alive": "forever", "keep_alive_s": -1.0, "expires_at": None}]
    lines = table(rows, now=1000.0).splitlines()
    assert lines[0].split() == ["NAME", "STATE", "HOST", "DEVICE", "LAST", "USED", "UNTIL"]
    assert lines[1].split() == ["opt-a", "resident", "1.3", "MB", "1.4", "MB", "10", "seconds", "ago", "4", "minutes",
                                "from", "now"]
    assert lines[2].split() == ["opt-b", "host", "2.0", "KB", "-", "never", "-"]
    assert lines[3].split()[:3] == ["sql", "(on", "opt-a)"] and lines[3].endswith("forever")
    column = lines[0].index("STATE")
    assert [ln.index(w) for ln, w in zip(lines, ("STATE", "resident", "host", "resident"))] == [column] * 4
    assert human_bytes(0) == "-" and human_bytes(999) == "999 B" and human_bytes(3 * 10**9) == "3.0 GB"


def test_the_serve_config_and_flag_read_keep_alive_and_name_a_bad_one(tmp_path):
    from computron.server.cli import _parser
    from computron.server.config import ConfigError, parse_engine
    assert parse_engine({"keep_alive": "30s"})[0].keep_alive == 30.0
    with pytest.raises(ConfigError, match=r"^engine\.keep_alive='5x': must be a duration"):
        parse_engine({"keep_alive": "5x"})
    args = _parser().parse_args(["serve", "--keep-alive", "5m", "--queue-size", "50", str(tmp_path)])
    assert (args.keep_alive, args.queue_size) == ("5m", 50)
    ps = _parser().parse_args(["ps", "--port", "8001", "--api-key", "k"])
    assert (ps.command, ps.port, ps.api_key, ps.url) == ("ps", 8001, "k", None)
