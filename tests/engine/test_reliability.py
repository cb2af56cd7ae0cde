"""No request can hang the engine: validation at submit, rank-agreed failures, liveness, bounded shutdown."""
import asyncio
import math
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from helpers import HANG_TOKEN, greedy_reference, hanging_lm

from computron import (CausalLMBatchManager, EngineConfig, EngineDeadError, LaunchEngine, ModelConfig,
                       PayloadError, QueueFullError, RequestTimeoutError, UnknownModelError, WorkerError, zoo)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)

SLACK_S = 8.0
"""What a deadline of the engine's may run late on a loaded 2-core machine (a starved thread wakes late):
the bounds below are the engine's own deadline plus this, far below what would be reached without it
(the defaults: 600 s for a command, the whole generation for a shutdown)."""

BAD_PARAMETERS = [
    ("seed", "abc"), ("seed", 2 ** 70), ("seed", -1), ("seed", 1.5), ("seed", True),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("temperature", "hot"),
    ("top_p", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5),
    ("attention_mask", [0, 0, 0]),
]


class LaxBatchManager(CausalLMBatchManager):
    """Lets any seed through to the workers, as a batch manager ported from elsewhere might."""

    def validate(self, data):
        data = {k: v for k, v in data.items() if k != "seed"}
        super().validate(data)


def test_bad_parameters_are_refused_or_fail_every_rank_together(checkpoints):
    path = checkpoints["opt0"]
    lax = LaxBatchManager.for_config(zoo.hf_config("opt-tiny"))
    configs = [ModelConfig("lm", zoo.load_causal_lm, {"path": path}),
               ModelConfig("lax", zoo.load_causal_lm, {"path": path}, batch_manager=lax)]
    ref = zoo.load_causal_lm(path)

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2), configs, 2, 2)
        async with engine:
            for name, value in BAD_PARAMETERS:
                data = {"input_ids": [2, 5, 6], "max_tokens": 4, "temperature": 1.0, name: value}
                with pytest.raises(PayloadError, match=name):
                    await engine.submit("lm", data)
            for model_id in (["lm"], {"lm": 1}, None, 3):
                with pytest.raises(UnknownModelError, match="unknown model id"):
                    await engine.submit(model_id, {"input_ids": [2]})
            # a seed only the output rank can choke on: every rank fails the step together
            for seed, error in ((2 ** 70, WorkerError), ("abc", PayloadError)):
                with pytest.raises(error):
                    await asyncio.wait_for(engine.submit(
                        "lax", {"input_ids": [2, 5], "max_tokens": 4, "temperature": 1.0, "seed": seed}), 60)
            sampled = {"input_ids": [2, 5, 6], "max_tokens": 6, "temperature": 1.0, "seed": 3}
            a, b = await engine.submit("lm", sampled), await engine.submit("lax", sampled)
            assert a.tolist() == b.tolist()
            good = await engine.submit("lax", {"input_ids": [2, 5, 6], "max_tokens": 6})
            assert good.tolist() == greedy_reference(ref, [2, 5, 6], 6).tolist()
            assert engine.is_alive
    asyncio.run(go())


def test_stopped_worker_is_detected_by_heartbeat(checkpoints):
    configs = [ModelConfig("lm", zoo.load_causal_lm, {"path": checkpoints["opt0"]})]

    async def go():
        engine = LaunchEngine(EngineConfig(heartbeat_timeout_s=2.0), configs, 1, 2)
        pid = engine.workers[1].pid
        try:
            stream = engine.stream("lm", {"input_ids": [2, 5], "max_tokens": 1500})
            await stream.__anext__()
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="rank 1 sent no heartbeat"):
                async for _ in stream:
                    pass
            assert time.monotonic() - t0 < 2.0 + SLACK_S
            assert not engine.is_alive
            with pytest.raises(EngineDeadError, match="heartbeat"):
                await engine.submit("lm", {"input_ids": [2]})
        finally:
            await engine.shutdown()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    asyncio.run(go())


def test_forward_stuck_forever_is_detected(checkpoints):
    configs = [ModelConfig("lm", hanging_lm, {"path": checkpoints["opt0"]})]

    async def go():
        engine = LaunchEngine(EngineConfig(command_timeout_s=3.0, heartbeat_timeout_s=2.0), configs, 1, 2)
        try:
            ok = await engine.submit("lm", {"input_ids": [2, 5], "max_tokens": 3})
            assert len(ok) == 3
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="stuck"):
                await asyncio.wait_for(engine.submit("lm", {"input_ids": [2, HANG_TOKEN], "max_tokens": 3}), 30)
            assert time.monotonic() - t0 < 3.0 + SLACK_S
            with pytest.raises(EngineDeadError):
                engine.run()
        finally:
            t0 = time.monotonic()
            await engine.shutdown()
            assert time.monotonic() - t0 < engine.config.shutdown_grace_s + SLACK_S
    asyncio.run(go())


SIGTERM_SCRIPT = """
import asyncio, sys, threading
from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
if __name__ == "__main__":
    path, step_mode, grace = sys.argv[1], sys.argv[2] == "step", float(sys.argv[3])
    engine = LaunchEngine(EngineConfig(step_mode=step_mode, shutdown_grace_s=grace),
                          [ModelConfig("lm", zoo.load_causal_lm, {"path": path})], 1, 2)
    loaded = threading.Event()
    engine.add_observer(lambda rec: rec.kind == "load" and loaded.set())
    request = {"input_ids": [2, 5], "max_tokens": 2000}
    async def main():
        if step_mode:
            async for _ in engine.stream("lm", request):
                print("GENERATING", flush=True)
        else:  # the worker takes the whole generation as one command once the model is in
            answer = asyncio.ensure_future(engine.submit("lm", request))
            await asyncio.get_running_loop().run_in_executor(None, loaded.wait)
            print("GENERATING", flush=True)
            await answer
    asyncio.run(main())
"""
SIGTERM_GRACE_S = 3.0
"""The whole generation takes twice the grace and the slack (23 s on an idle machine: 2000 tokens of an
8-layer model, no EOS among them), so a shutdown that waited it out fails."""


@pytest.fixture(scope="module")
def slow_lm(tmp_path_factory):
    return zoo.save_random_causal_lm("opt-small", str(tmp_path_factory.mktemp("slow") / "lm"), seed=0)


@pytest.mark.parametrize("mode", ["step", "request"])
def test_sigterm_during_long_generation_is_bounded(slow_lm, tmp_path, mode):
    """SIGTERM mid-generation: the workers get the grace to finish their command, then are killed; the
    process is gone well before the generation could have ended."""
    script = tmp_path / "long_generation.py"
    script.write_text(SIGTERM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, str(script), slow_lm, mode, str(SIGTERM_GRACE_S)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bound = SIGTERM_GRACE_S + SLACK_S
    try:
        line = proc.stdout.readline()
        assert line.strip() == "GENERATING", line + proc.stderr.read()
        workers = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the engine's process still ran {bound:.0f}s after SIGTERM")
        _, alive = psutil.wait_procs(workers, timeout=max(0.1, t0 + bound - time.monotonic()))
        alive = [p for p in alive if _running(p)]
        assert not alive, f"still running {time.monotonic() - t0:.1f}s after SIGTERM: {[p.pid for p in alive]}"
        if mode == "request":  # the worker was mid-command: the grace ran out and it was killed
            stderr = proc.stderr.read()
            assert "did not exit within" in stderr and "killing it" in stderr, stderr[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # a zombie has exited; only its parent can reap it
    except psutil.NoSuchProcess:
        return False


def test_chaos(checkpoints):
    """Concurrent requests over two swapping models, cancellations, bad inputs and one worker kill:
    no request hangs, every answer that arrives is the right one, nothing is left behind."""
    paths = {"a": checkpoints["opt0"], "b": checkpoints["opt1"]}
    refs = {m: zoo.load_causal_lm(p) for m, p in paths.items()}
    configs = [ModelConfig(m, zoo.load_causal_lm, {"path": p}) for m, p in paths.items()]
    rng = random.Random(0)
    expected_errors = (PayloadError, UnknownModelError, QueueFullError, RequestTimeoutError, EngineDeadError)

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=1, queue_size=40), configs, 2, 1)
        try:
            answered = []

            async def good(i):
                m = "ab"[i % 2]
                prompt = [2] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 8))]
                n = rng.randrange(1, 24)
                if i % 3 == 0:
                    out = [t async for t in engine.stream(m, {"input_ids": prompt, "max_tokens": n})]
                else:
                    out = (await engine.submit(m, {"input_ids": prompt, "max_tokens": n})).tolist()
                assert out == greedy_reference(refs[m], prompt, n).tolist(), (m, prompt, n)
                answered.append(i)

            async def cancelled(i):
                agen = engine.stream("ab"[i % 2], {"input_ids": [2, 7 + i], "max_tokens": 200})
                async for _ in agen:
                    break
                await agen.aclose()

            async def bad(i):
                data = [{"input_ids": [2], "seed": -5, "temperature": 1.0}, {"input_ids": []},
                        {"input_ids": [2], "max_tokens": 10 ** 6}, "text"][i % 4]
                with pytest.raises(PayloadError):
                    await engine.submit("ab"[i % 2], data)

            jobs = [good(i) if i % 5 else (cancelled(i) if i % 10 else bad(i)) for i in range(60)]
            results = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 120)
            assert not [r for r in results if r is not None and not isinstance(r, expected_errors)], results
            assert len(answered) >= 30
            # a worker dies with requests in flight: every one of them ends with EngineDeadError
            inflight = [asyncio.ensure_future(engine.submit("ab"[i % 2], {"input_ids": [2, 9], "max_tokens": 300}))
                        for i in range(8)]
            stream = engine.stream("a", {"input_ids": [2, 11], "max_tokens": 300})
            await stream.__anext__()
            os.kill(engine.workers[1].pid, signal.SIGKILL)
            ends = await asyncio.wait_for(asyncio.gather(*inflight, return_exceptions=True), 30)
            assert all(isinstance(e, (EngineDeadError, torch.Tensor)) for e in ends), ends
            assert any(isinstance(e, EngineDeadError) for e in ends)
            with pytest.raises(EngineDeadError, match=r"rank 1 exited unexpectedly \(exit code -9\)"):
                await asyncio.wait_for(stream.__anext__(), 30)
        finally:
            await engine.shutdown()
    asyncio.run(go())


class _Replies:
    """A worker's channel that keeps what it is given, or raises ``fail`` on ``reply``."""

    def __init__(self, fail=None):
        self.sent, self.fail = [], fail

    def reply(self, m):
        if self.fail is not None:
            raise self.fail
        self.sent.append(m)


def _bare_worker(channel):
    from computron.worker.worker import Worker
    return Worker(0, None, channel, [], EngineConfig(), torch.device("cpu"))


@pytest.mark.parametrize("where", ["building", "sending"])
def test_heartbeat_thread_never_stops_silently(where, caplog, monkeypatch):
    worker = _bare_worker(_Replies(fail=ConnectionError("gone") if where == "sending" else None))
    if where == "building":
        monkeypatch.setattr(worker, "_heartbeat_message", lambda: 1 / 0)
    with caplog.at_level("WARNING", logger="computron.worker"):
        worker.start_heartbeat(0.01)
        worker._heartbeat.join(timeout=10)
    assert not worker._heartbeat.is_alive()
    (rec,) = [r for r in caplog.records if "heartbeats stop" in r.getMessage()]
    if where == "building":  # a bug: its traceback is in the log
        assert rec.exc_info is not None and rec.exc_info[0] is ZeroDivisionError
    else:
        assert "ConnectionError: gone" in rec.getMessage()


def test_command_failures_carry_their_type_and_whether_they_are_only_upstream():
    from computron.comm import messages as msg
    from computron.comm.p2p import UpstreamFailed
    from computron.worker.worker import is_fatal_transport_error
    channel = _Replies()
    worker = _bare_worker(channel)
    own = worker._failure(3, "m", ValueError("bad"))
    upstream = worker._failure(3, "m", UpstreamFailed("pipeline stage of rank 0 failed on this batch"))
    assert (own.exc_type, own.upstream, own.error) == ("ValueError", False, "ValueError: bad")
    assert (upstream.exc_type, upstream.upstream) == ("UpstreamFailed", True)
    assert not is_fatal_transport_error(UpstreamFailed("gloo connection closed"))
    assert is_fatal_transport_error(RuntimeError("gloo: connection closed by peer"))
    worker._execute(msg.QueryStats(seq=5))
    with pytest.raises(TypeError, match="unknown command"):
        worker._execute(msg.Shutdown())  # the loop ends on it: no handler
    assert isinstance(channel.sent[0], msg.Stats) and channel.sent[0].seq == 5
