"""Models added, replaced and removed while the engine serves, in process over fake workers
(``fake_workers.py``): which commands go out and when, what requests get, what the engine reports."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fake_workers, whatever the import mode

from fake_workers import build_engine, expected_tokens, model_fn  # noqa: E402
from test_engine_inprocess import async_test, gen, result, started  # noqa: E402

from computron.comm import messages as msg  # noqa: E402
from computron.config import ModelConfig  # noqa: E402
from computron.errors import (EngineDeadError, ModelChangeError, ModelConflictError,  # noqa: E402
                              UnknownModelError)
from computron.preflight import PreflightError  # noqa: E402


async def sent(w, cls, model_id):
    """The first unanswered ``cls`` command for ``model_id``, once the engine has sent it (a change's
    preflight runs on another thread first)."""
    return await asyncio.to_thread(w.channel.wait_for, lambda c: isinstance(c, cls) and c.model_id == model_id
                                   and len(w.replied[c.seq]) < w.n_workers)


async def add(engine, w, mc):
    """Add ``mc`` and answer its AddModel on every rank."""
    task = asyncio.ensure_future(engine.add_model(mc))
    w.answer(await sent(w, msg.AddModel, mc.model_id))
    await result(task)


@async_test
async def test_an_added_model_is_unknown_until_every_rank_built_it_then_serves():
    engine, w = build_engine(tp=2)
    task = asyncio.ensure_future(engine.add_model(ModelConfig("b", model_fn)))
    cmd = await sent(w, msg.AddModel, "b")
    assert cmd.config.model_id == "b" and cmd.config.batch_manager is None
    w.answer(cmd, ranks=[0])
    with pytest.raises(UnknownModelError, match="'b'"):
        await engine.submit("b", gen())
    w.answer(cmd, ranks=[1])
    await result(task)
    assert engine.model_ids == ["a", "b"] and engine.model_states()["b"] == "offloaded"
    out = await started(engine.submit("b", gen(max_tokens=3)))
    w.answer_all()
    assert (await result(out)).tolist() == expected_tokens(0, 3, 3)
    assert engine.snapshot().models["b"].version == 1


@async_test
async def test_adding_a_served_id_or_changing_one_that_is_changing_is_refused():
    engine, w = build_engine()
    with pytest.raises(ModelConflictError, match="'a' is already served"):
        await engine.add_model(ModelConfig("a", model_fn))
    task = asyncio.ensure_future(engine.add_model(ModelConfig("b", model_fn)))
    await sent(w, msg.AddModel, "b")
    with pytest.raises(ModelConflictError, match="'b' is adding"):
        await engine.add_model(ModelConfig("b", model_fn))
    w.answer_all()
    await result(task)
    with pytest.raises(ValueError, match="may not end in '@v<number>'"):
        await engine.add_model(ModelConfig("c@v3", model_fn))
    assert [type(c).__name__ for c in w.channel.sent] == ["AddModel"]


@async_test
async def test_an_added_config_gets_the_launch_preflight():
    engine, w = build_engine()
    bad = ModelConfig("b", model_fn, checkpoint="/nonexistent/checkpoint")
    with pytest.raises(PreflightError, match="model 'b'.*does not exist|model 'b'.*not"):
        await engine.add_model(bad)
    with pytest.raises(PreflightError, match="cannot be pickled"):
        await engine.add_model(ModelConfig("c", lambda: None))
    assert w.channel.sent == []


@async_test
async def test_a_build_failing_on_one_rank_fails_the_add_frees_the_others_and_serving_goes_on():
    engine, w = build_engine(tp=2)
    task = asyncio.ensure_future(engine.add_model(ModelConfig("b", model_fn)))
    cmd = await sent(w, msg.AddModel, "b")
    w.answer(cmd, ranks=[0])
    w.fail(cmd, 1, "OSError: disk full")
    with pytest.raises(ModelChangeError, match="adding model 'b' failed: rank 1: OSError: disk full"):
        await result(task)
    assert w.channel.kinds()[-1] == ("RemoveModel", "b")  # what rank 0 built
    w.answer_all()
    assert engine.model_ids == ["a"]
    out = await started(engine.submit("a", gen(max_tokens=2)))
    w.answer_all()
    assert (await result(out)).tolist() == expected_tokens(0, 3, 2)
    # the id is free again
    await add(engine, w, ModelConfig("b", model_fn))
    assert engine.model_ids == ["a", "b"]


@async_test
async def test_a_model_too_big_for_the_device_budget_is_refused_and_freed():
    engine, w = build_engine(device_budget=1500, max_loaded=None, kv_reserve=0.0)
    w.nbytes = 2000
    task = asyncio.ensure_future(engine.add_model(ModelConfig("big", model_fn)))
    w.answer(await sent(w, msg.AddModel, "big"))
    with pytest.raises(ModelChangeError, match="big"):
        await result(task)
    assert w.channel.kinds()[-1] == ("RemoveModel", "big")
    assert engine.model_ids == ["a"]


@async_test
async def test_remove_drains_admitted_requests_refuses_new_ones_then_frees_every_rank():
    engine, w = build_engine(("a", "b"), tp=2)
    running = await started(engine.submit("a", gen(max_tokens=3)))
    w.answer()  # Load a
    w.answer()  # step 1
    waiting = await started(engine.submit("a", gen(prompt=(9,), max_tokens=2)))
    removal = asyncio.ensure_future(engine.remove_model("a"))
    await asyncio.sleep(0)  # a yield point for the loop: the removal is under way
    with pytest.raises(UnknownModelError, match="unknown model id 'a'"):
        await engine.submit("a", gen())
    assert engine.model_ids == ["b"]
    assert not w.channel.of_type(msg.RemoveModel)
    w.answer_until(lambda: w.channel.of_type(msg.RemoveModel))
    assert (await result(running)).tolist() == expected_tokens(0, 3, 3)
    assert (await result(waiting)).tolist() == expected_tokens(1, 1, 2)
    last_step = max(i for i, c in enumerate(w.channel.sent) if isinstance(c, msg.Step))
    assert w.channel.sent.index(w.channel.of_type(msg.RemoveModel)[0]) > last_step
    assert not removal.done()  # until every rank freed it
    w.answer_all()
    await result(removal)
    assert w.removed == ["a"]
    # its slot is free: b loads without an offload of a
    out = await started(engine.submit("b", gen(max_tokens=1)))
    w.answer_all()
    await result(out)
    assert w.channel.of_type(msg.Offload) == []


@async_test
async def test_remove_without_drain_fails_waiting_and_running_requests_at_once():
    engine, w = build_engine(overlap=False)
    running = await started(engine.submit("a", gen(max_tokens=10)))
    w.answer()  # Load
    waiting = await started(engine.submit("a", gen(max_tokens=10)))
    removal = asyncio.ensure_future(engine.remove_model("a", drain=False))
    for task in (running, waiting):
        with pytest.raises(UnknownModelError, match="'a'"):
            await result(task)
    w.answer_all()
    await result(removal)
    assert w.removed == ["a"] and w.sequences.get("a", {}) == {}
    assert engine.counters()["requests"][("a", "error")] == 2


@async_test
async def test_replace_keeps_admitted_requests_on_the_old_version_and_frees_it_after():
    engine, w = build_engine(overlap=False)
    old = await started(engine.submit("a", gen(max_tokens=3)))
    w.answer()  # Load a
    w.answer()  # step 1 of the old version
    task = asyncio.ensure_future(engine.replace_model("a", ModelConfig("ignored", model_fn)))
    cmd = await sent(w, msg.AddModel, "a@v2")
    assert cmd.config.model_id == "a@v2"
    during = await started(engine.submit("a", gen(prompt=(4,), max_tokens=1)))  # the id is never unknown
    w.answer(cmd)
    await result(task)
    after = await started(engine.submit("a", gen(prompt=(8,), max_tokens=2)))
    assert engine.snapshot().models["a"].version == 2
    w.answer_all()
    assert (await result(old)).tolist() == expected_tokens(0, 3, 3)
    assert (await result(during)).tolist() == expected_tokens(1, 1, 1)
    assert (await result(after)).tolist() == expected_tokens(2, 1, 2)
    assert {s.admit[0].sid for s in w.channel.of_type(msg.Step, "a") if s.admit} == {0, 1}
    assert {s.admit[0].sid for s in w.channel.of_type(msg.Step, "a@v2") if s.admit} == {2}
    assert w.removed == ["a"]  # the first version, once drained
    assert engine.model_ids == ["a"] and engine.snapshot().models["a"].draining_versions == 0


@async_test
async def test_remove_waits_for_the_draining_old_version_too():
    engine, w = build_engine(overlap=False)
    old = await started(engine.submit("a", gen(max_tokens=3)))
    w.answer()
    task = asyncio.ensure_future(engine.replace_model("a", ModelConfig("a", model_fn)))
    w.answer(await sent(w, msg.AddModel, "a@v2"))
    await result(task)
    assert engine.snapshot().models["a"].draining_versions == 1
    removal = asyncio.ensure_future(engine.remove_model("a"))
    await asyncio.sleep(0)
    w.answer_all()
    await result(removal)
    assert (await result(old)).tolist() == expected_tokens(0, 3, 3)
    assert sorted(w.removed) == ["a", "a@v2"]
    with pytest.raises(UnknownModelError):
        await engine.remove_model("a")


@async_test
async def test_pinning_and_priority_at_runtime():
    engine, w = build_engine(("a", "b", "c"), max_loaded=2)
    with pytest.raises(UnknownModelError):
        engine.set_pinned("zzz", True)
    with pytest.raises(ValueError, match="must be True or False"):
        engine.set_pinned("a", "yes")
    with pytest.raises(ValueError, match="must be an int"):
        engine.set_priority("a", 1.5)
    for m in ("a", "b"):
        t = await started(engine.submit(m, gen(max_tokens=1)))
        w.answer_all()
        await result(t)
    engine.set_pinned("a", True)  # a is the least recently used: b goes instead
    assert engine.snapshot().models["a"].pinned
    t = await started(engine.submit("c", gen(max_tokens=1)))
    w.answer_all()
    await result(t)
    assert [o.model_id for o in w.channel.of_type(msg.Offload)] == ["b"]
    engine.set_pinned("a", False)
    engine.set_priority("a", 5)  # now b (lower priority) is evicted rather than a
    t = await started(engine.submit("b", gen(max_tokens=1)))
    w.answer_all()
    await result(t)
    assert [o.model_id for o in w.channel.of_type(msg.Offload)] == ["b", "c"]


@async_test
async def test_a_change_under_way_fails_when_the_engine_dies():
    engine, w = build_engine()
    task = asyncio.ensure_future(engine.add_model(ModelConfig("b", model_fn)))
    await sent(w, msg.AddModel, "b")
    engine.on_worker_exit(0, -9)
    with pytest.raises(EngineDeadError, match="exited unexpectedly"):
        await result(task)
    with pytest.raises(EngineDeadError):
        await engine.remove_model("a")


@async_test
async def test_a_request_level_model_added_at_runtime_runs_batches():
    engine, w = build_engine()
    w.request_level.add("r")
    await add(engine, w, ModelConfig("r", model_fn))
    out = await started(engine.submit("r", 21))
    w.answer_all()
    assert await result(out) == 42
    assert not engine.snapshot().models["r"].token_level
