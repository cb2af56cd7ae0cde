"""One engine's liveness on a busy machine and without its master (real workers).

- An idle engine whose workers are starved of CPU for 30 s (pinned to one core with two busy-loop processes of
  the highest priority, the workers niced down) stays alive, reports them late, and answers afterwards.
- A SIGSTOPped rank 1 of 2 is declared dead within the heartbeat timeout, named (not rank 0) with its host.
- Workers whose master is SIGKILLed, or stopped (unreachable), exit by themselves within
  ``EngineConfig.master_timeout_s``, each saying why in one line, no traceback; no process is left.
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from helpers import command_env, free_port, greedy_reference

from computron import EngineConfig, EngineDeadError, LaunchEngine, ModelConfig, zoo

pytestmark = pytest.mark.timeout(400)
SLACK_S = 8.0
"""What a deadline of the engine's may run late on a loaded 2-core machine (see test_reliability)."""
STARVE_S = 30.0
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="raising the hogs' priority needs root")


def _threads(pid):
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _hog(core):
    code = ("import os; os.sched_setaffinity(0, {%d}); os.setpriority(os.PRIO_PROCESS, 0, -20)\nwhile True: pass"
            % core)
    return subprocess.Popen([sys.executable, "-c", code])


@needs_root
def test_an_idle_engine_whose_workers_starve_stays_alive_and_answers(checkpoints):
    path = checkpoints["opt0"]
    configs = [ModelConfig("lm", zoo.load_causal_lm, {"path": path})]
    prompt, ref = [2, 5, 6], greedy_reference(path, [2, 5, 6], 5).tolist()
    core = max(os.sched_getaffinity(0))

    async def go():
        engine = LaunchEngine(EngineConfig(heartbeat_timeout_s=2.0, max_loaded=1), configs, 1, 2)
        async with engine:
            assert (await engine.submit("lm", {"input_ids": prompt, "max_tokens": 5})).tolist() == ref
            pids = [w.pid for w in engine.workers.values()]
            for pid in pids:
                for tid in _threads(pid):
                    os.sched_setaffinity(tid, {core})
                    os.setpriority(os.PRIO_PROCESS, tid, 19)
            hogs = [_hog(core), _hog(core)]
            try:
                assert not threading.Event().wait(STARVE_S)  # the starvation itself: 30 s
                assert engine.is_alive, engine.dead_reason
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            for pid in pids:
                for tid in _threads(pid):
                    os.setpriority(os.PRIO_PROCESS, tid, 0)
                    os.sched_setaffinity(tid, os.sched_getaffinity(0))
            late = engine.counters()["late_heartbeats"]
            assert sum(late.values()) >= 1, "the workers were never late: the test starved nothing"
            assert (await engine.submit("lm", {"input_ids": prompt, "max_tokens": 5})).tolist() == ref
            assert engine.is_alive
    asyncio.run(go())


def test_a_stopped_rank_is_named_dead_within_the_heartbeat_timeout(checkpoints):
    configs = [ModelConfig("lm", zoo.load_causal_lm, {"path": checkpoints["opt0"]})]

    async def go():
        engine = LaunchEngine(EngineConfig(heartbeat_timeout_s=2.0), configs, 1, 2)
        pid = engine.workers[1].pid
        try:
            await engine.submit("lm", {"input_ids": [2, 5], "max_tokens": 2})
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(asyncio.to_thread(engine.run), 2.0 + SLACK_S)
            assert time.monotonic() - t0 < 2.0 + SLACK_S
            assert engine.dead_reason.startswith("engine is dead: worker rank 1 sent no heartbeat for ")
            assert f"(host {socket.gethostname()}: its process is stopped (SIGSTOP or a debugger))" \
                in engine.dead_reason
            assert "rank 0" not in engine.dead_reason
            with pytest.raises(EngineDeadError, match="rank 1 sent no heartbeat"):
                await engine.submit("lm", {"input_ids": [2]})
        finally:
            await engine.shutdown()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    asyncio.run(go())


NODE = textwrap.dedent("""
    import json, sys
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    if __name__ == "__main__":
        node, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        config = EngineConfig(master_port=port, heartbeat_timeout_s=2.0, master_timeout_s=4.0)
        engine = LaunchEngine(config, [ModelConfig("lm", zoo.load_causal_lm, {"path": path})], 2, 1,
                              n_nodes=2, node_rank=node)
        if engine is not None:
            import asyncio
            print(asyncio.run(engine.submit("lm", {"input_ids": [2, 5], "max_tokens": 3})).tolist())
            print(json.dumps({r: w.pid for r, w in engine.workers.items()}), flush=True)
            sys.stdin.read()  # serves until killed
""")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_workers_exit_by_themselves_when_their_master_is_gone(checkpoints, tmp_path, how):
    script = tmp_path / "node.py"
    script.write_text(NODE)
    port = free_port()
    env = command_env(GLOO_SOCKET_IFNAME="lo")
    logs = [open(tmp_path / f"node{n}.log", "w+") for n in (0, 1)]
    nodes = [subprocess.Popen([sys.executable, str(script), str(n), str(port), checkpoints["opt0"]], env=env,
                              stdin=subprocess.PIPE, stdout=logs[n] if n else subprocess.PIPE, stderr=logs[n],
                              text=True) for n in (0, 1)]
    family = []
    try:
        first = nodes[0].stdout.readline()
        if not first:  # node 0 ended: say why
            nodes[0].wait(timeout=60)
            logs[0].seek(0)
            pytest.fail(f"node 0 exited with {nodes[0].returncode}: {logs[0].read()[-3000:]}")
        assert first.strip() == str(greedy_reference(checkpoints["opt0"], [2, 5], 3).tolist()), first
        pids = json.loads(nodes[0].stdout.readline())
        workers = [psutil.Process(p) for p in pids.values()]
        family = [c for n in nodes for c in psutil.Process(n.pid).children(recursive=True)]
        os.kill(nodes[0].pid, getattr(signal, how))
        gone, alive = psutil.wait_procs(workers, timeout=4.0 + SLACK_S)
        assert alive == [], f"workers still there after the master's {how}"
        assert nodes[1].wait(30) == 0  # the other node's launcher returns once its worker left
        logs[1].seek(0)
        text = logs[1].read()
        assert "rank 1: the master is gone (" in text
        assert "Traceback" not in text
        if how == "SIGSTOP":  # nothing broke: nothing was heard
            assert "nothing heard from it for" in text
            logs[0].seek(0)
            assert "its process stopped" in logs[0].read()  # rank 0 shares its master's host: it looked
    finally:
        for n in nodes:
            n.kill()
            n.wait(30)
        _, left = psutil.wait_procs(family, timeout=30)
        for p in left:
            p.kill()
        for f in logs:
            f.close()
    assert left == []


class _Beats:
    remote = False

    def __init__(self):
        self.sent = []

    def reply(self, m):
        self.sent.append(m)


def test_heartbeats_go_on_while_one_long_torch_op_holds_the_command_loop():
    # torch releases the GIL inside its kernels: the heartbeat thread sends while one matmul runs
    import torch

    from computron.worker.worker import Worker
    channel = _Beats()
    worker = Worker(0, None, channel, [], EngineConfig(), torch.device("cpu"))
    a = torch.randn(3000, 3000)
    worker.start_heartbeat(0.01)
    try:
        t0 = time.time()
        a @ a  # one call into torch, several hundred milliseconds at least on these machines
        t1 = time.time()
    finally:
        worker._stop_heartbeat.set()
        worker._heartbeat.join(10)
    during = [b for b in channel.sent if t0 < b.sent < t1]
    assert during, f"no heartbeat during a {t1 - t0:.2f}s matmul"
