"""``Engine.set_host_models`` in process over fake workers (``fake_workers.py``): what goes to the ranks and
when, the ids it takes, and what the snapshot says."""
from __future__ import annotations

import asyncio
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fake_workers, whatever the import mode

from fake_workers import build_engine, model_fn  # noqa: E402
from test_engine_inprocess import async_test, result  # noqa: E402

from computron.comm import messages as msg  # noqa: E402
from computron.config import ModelConfig  # noqa: E402
from computron.errors import UnknownModelError, WorkerError  # noqa: E402


async def sent(w, cls, pred=lambda c: True):
    """The first unanswered ``cls`` command ``pred`` accepts, once the engine has sent it."""
    return await asyncio.to_thread(w.channel.wait_for, lambda c: isinstance(c, cls) and pred(c)
                                   and len(w.replied[c.seq]) < w.n_workers)


async def plan(engine, w, ids):
    task = asyncio.ensure_future(engine.set_host_models(ids))
    cmd = await sent(w, msg.SetHostModels)
    assert not task.done()  # it waits for every rank's reads ahead
    w.answer(cmd)
    return cmd, await result(task)


@async_test
async def test_the_set_goes_to_every_rank_and_the_snapshot_says_it():
    engine, w = build_engine(("a", "b", "c"), tp=2, host_budget=10_000)
    cmd, kept = await plan(engine, w, ["c", "a", "c"])
    assert kept is True and cmd.model_ids == ("c", "a")  # in order, once each
    snap = engine.snapshot().models
    assert [m for m in "abc" if snap[m].host_plan] == ["a", "c"]
    assert snap["b"].host_bytes == w.nbytes
    _, kept = await plan(engine, w, [])  # replaces the set
    assert kept and not any(s.host_plan for s in engine.snapshot().models.values())


@async_test
async def test_an_unknown_id_fails_before_any_rank_hears_of_it():
    engine, w = build_engine(("a", "b"), host_budget=10_000)
    with pytest.raises(UnknownModelError, match="'nope'.*served models: \\['a', 'b'\\]"):
        await engine.set_host_models(["a", "nope"])
    with pytest.raises(TypeError, match="not one id"):
        await engine.set_host_models("a")
    assert not w.channel.of_type(msg.SetHostModels)
    assert not any(s.host_plan for s in engine.snapshot().models.values())


@async_test
async def test_a_failed_rank_fails_the_call():
    engine, w = build_engine(("a",), tp=2, host_budget=10_000)
    task = asyncio.ensure_future(engine.set_host_models(["a"]))
    cmd = await sent(w, msg.SetHostModels)
    w.answer(cmd, ranks=[0])
    w.fail(cmd, 1, "RuntimeError: the read-ahead thread broke")
    with pytest.raises(WorkerError, match="read-ahead thread broke"):
        await result(task)


@async_test
async def test_a_new_version_of_a_planned_id_is_planned_and_a_removed_id_leaves_the_plan():
    engine, w = build_engine(("a", "b"), host_budget=10_000)
    await plan(engine, w, ["a", "b"])
    task = asyncio.ensure_future(engine.replace_model("a", ModelConfig("a", model_fn)))
    w.answer(await sent(w, msg.AddModel))
    again = await sent(w, msg.SetHostModels)  # sent as the new version is served
    assert again.model_ids == ("a@v2", "b")
    w.answer_all()
    await result(task)
    removal = asyncio.ensure_future(engine.remove_model("b"))
    await asyncio.to_thread(w.channel.wait_for, lambda c: isinstance(c, msg.RemoveModel) and c.model_id == "b")
    w.answer_all()
    await result(removal)
    adding = asyncio.ensure_future(engine.add_model(ModelConfig("b", model_fn)))  # a new "b": not planned
    w.answer(await sent(w, msg.AddModel))
    await result(adding)
    snap = engine.snapshot().models
    assert snap["a"].host_plan and not snap["b"].host_plan
    assert len(w.channel.of_type(msg.SetHostModels)) == 2  # removing or adding sent none: the ranks forget "b"


@async_test
async def test_without_a_host_budget_it_is_a_no_op_that_says_so(caplog):
    engine, w = build_engine(("a",))
    with caplog.at_level(logging.INFO, logger="computron.engine"):
        assert await engine.set_host_models(["a"]) is False
        assert await engine.set_host_models([]) is False
        with pytest.raises(UnknownModelError):
            await engine.set_host_models(["nope"])
    assert not w.channel.of_type(msg.SetHostModels)
    assert sum("no EngineConfig.host_budget" in r.message for r in caplog.records) == 1
