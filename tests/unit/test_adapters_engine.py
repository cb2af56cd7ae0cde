"""LoRA adapters on the master, in process over fake workers: routing to the base, one load for the base
and its adapters, the adapters' device slots per step, changes while serving and what they refuse."""
from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fake_workers, whatever the import mode

from fake_workers import build_engine, expected_tokens, model_fn  # noqa: E402
from test_engine_inprocess import async_test, gen, result, started  # noqa: E402
from test_model_changes_inprocess import sent  # noqa: E402

from computron.comm import messages as msg  # noqa: E402
from computron.config import ModelConfig  # noqa: E402
from computron.engine import core  # noqa: E402
from computron.errors import ModelConflictError, UnknownModelError  # noqa: E402


@dataclass(frozen=True)
class Info:
    """What the master's adapter check returns, as far as the engine reads it."""
    r: int = 4
    nbytes: int = 1000


@pytest.fixture(autouse=True)
def no_files(monkeypatch):
    """The adapters here have no files: the master's check (tested with real files elsewhere) passes."""
    monkeypatch.setattr(core, "check_adapter_config", lambda mc, base, max_rank: Info())


def adapter(aid, base="a"):
    return ModelConfig(aid, base=base, adapter=f"/adapters/{aid}")


async def add(engine, w, mc):
    task = asyncio.ensure_future(engine.add_model(mc))
    w.answer(await sent(w, msg.AddAdapter, mc.base))
    await result(task)


@async_test
async def test_adapter_requests_run_on_their_base_in_one_step_after_one_load():
    engine, w = build_engine(("a", "b"), overlap=False, max_loras=2)
    await add(engine, w, adapter("x"))
    await add(engine, w, adapter("y"))
    assert engine.model_ids == ["a", "b", "x", "y"] and engine.adapters == {"x": "a", "y": "a"}
    assert [c.adapter_id for c in w.channel.of_type(msg.AddAdapter)] == ["x", "y"]
    tasks = [await started(engine.submit(m, gen(max_tokens=2))) for m in ("x", "a", "y", "x")]
    w.answer_all()
    outs = [(await result(t)).tolist() for t in tasks]
    assert outs == [expected_tokens(i, 3, 2) for i in range(4)]
    assert [c.model_id for c in w.channel.of_type(msg.Load)] == ["a"]  # one load serves them all
    first = w.channel.of_type(msg.Step, "a")[0]
    assert [s.adapter for s in first.admit] == ["x", None, "y", "x"]
    assert engine.model_states()["x"] == "loaded" and engine.snapshot().models["y"].base == "a"
    records = engine.metrics("request")
    assert [r.adapter for r in records] == ["x", None, "y", "x"] and {r.model_id for r in records} == {"a"}


@async_test
async def test_a_step_uses_at_most_max_loras_distinct_adapters():
    engine, w = build_engine(overlap=False, max_loras=2)
    for a in ("x", "y", "z"):
        await add(engine, w, adapter(a))
    tasks = [await started(engine.submit(m, gen(max_tokens=2))) for m in ("x", "y", "z", "a")]
    w.answer_all()
    for t in tasks:
        await result(t)
    admitted = [[s.adapter for s in st.admit] for st in w.channel.of_type(msg.Step, "a")]
    # z waits (in arrival order, the bare model's request behind it) until x and y are done
    assert admitted == [["x", "y"], [], ["z", None], []]


@async_test
async def test_removing_an_adapter_drains_it_and_refuses_new_requests():
    engine, w = build_engine(overlap=False)
    await add(engine, w, adapter("x"))
    running = await started(engine.submit("x", gen(max_tokens=3)))
    w.answer()  # Load
    w.answer()  # step 1
    removal = asyncio.ensure_future(engine.remove_model("x"))
    await asyncio.sleep(0)  # a yield point: the removal is under way
    with pytest.raises(UnknownModelError, match="'x'"):
        await engine.submit("x", gen())
    assert not w.channel.of_type(msg.RemoveAdapter)
    w.answer_all()
    assert (await result(running)).tolist() == expected_tokens(0, 3, 3)
    await result(removal)
    assert [c.adapter_id for c in w.channel.of_type(msg.RemoveAdapter)] == ["x"]
    assert engine.model_ids == ["a"]


@async_test
async def test_adapter_changes_that_are_refused():
    engine, w = build_engine(("a", "b"))
    with pytest.raises(UnknownModelError, match="'nope'"):
        await engine.add_model(adapter("x", base="nope"))
    await add(engine, w, adapter("x"))
    with pytest.raises(ModelConflictError, match="already served"):
        await engine.add_model(adapter("x", base="b"))
    with pytest.raises(ModelConflictError, match=r"has adapters \['x'\]"):
        await engine.remove_model("a")
    with pytest.raises(ModelConflictError, match=r"has adapters \['x'\]"):
        await engine.replace_model("a", ModelConfig("a", model_fn))
    with pytest.raises(ModelConflictError, match="not replaced in place"):
        await engine.replace_model("x", adapter("x"))
    removal = asyncio.ensure_future(engine.remove_model("x"))
    await asyncio.sleep(0)
    w.answer_all()
    await result(removal)
    task = asyncio.ensure_future(engine.remove_model("a"))
    await asyncio.sleep(0)
    w.answer_all()
    await result(task)
    assert engine.model_ids == ["b"]


@async_test
async def test_an_adapter_that_fails_on_a_rank_fails_alone():
    engine, w = build_engine(tp=2)
    task = asyncio.ensure_future(engine.add_model(adapter("x")))
    cmd = await sent(w, msg.AddAdapter, "a")
    w.answer(cmd, ranks=[0])
    w.fail(cmd, 1, "AdapterError: adapter 'x': shapes do not fit")
    with pytest.raises(Exception, match="adding adapter 'x' failed: rank 1: AdapterError"):
        await result(task)
    assert w.channel.kinds()[-1] == ("RemoveAdapter", "a")
    w.answer_all()
    assert engine.model_ids == ["a"]
    out = await started(engine.submit("a", gen(max_tokens=2)))
    w.answer_all()
    assert (await result(out)).tolist() == expected_tokens(0, 3, 2)
