"""The liveness policy (late vs dead, the report naming every silent rank) on a clock and processes of the
test's own, and the process probe on real processes (milliseconds)."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from computron.comm import messages as msg
from computron.comm import process_probe
from computron.comm.process_probe import ProcessSample, process_sign
from computron.engine import liveness
from computron.engine.liveness import Liveness

HERE = socket.gethostname()


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(liveness, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    return now


def ready(rank, host=HERE, pid=None):
    return msg.WorkerReady(rank=rank, pid=100 + rank if pid is None else pid, host=host, device="cpu")


def make(workers, samples, late_limit_s=60.0, timeout_s=10.0):
    """A Liveness whose probe answers from ``samples`` (pid -> the next ProcessSample, popped in turn)."""
    late = []
    lv = Liveness(len(workers), timeout_s, 600.0, late_limit_s, {w.rank: w for w in workers},
                  on_late=late.append, probe=lambda pid: samples[pid].pop(0))
    return lv, late


def running(cpu=0, wait=0, runnable=False):
    return ProcessSample(process_probe.RUNNING, cpu, wait, runnable)


def test_report_names_all_silent_ranks_longest_first(clock):
    lv, _ = make([ready(0, "node-a"), ready(1, "node-b"), ready(2, "node-b")], {})
    clock[0] = 1003.0
    lv.heard_from(0)
    assert lv.verdict(1010.0) is None
    assert lv.verdict(1014.0) == (
        "worker rank 1 sent no heartbeat for 14.0s (host node-b), rank 2 for 14.0s (host node-b), "
        "rank 0 for 11.0s (host node-a) (EngineConfig.heartbeat_timeout_s=10.0); it is hung, stopped or gone")


def test_a_stopped_or_exited_local_worker_is_dead_at_the_timeout(clock):
    lv, late = make([ready(0), ready(1)], {101: [running(5, 5), ProcessSample(process_probe.STOPPED, 5, 5)]})
    clock[0] = 1005.0
    lv.heard_from(0)
    assert lv.verdict(1006.0) is None  # the first look, before the timeout
    clock[0] = 1011.0
    lv.heard_from(0)
    assert lv.verdict(1011.0) == (
        "worker rank 1 sent no heartbeat for 11.0s (host %s: its process is stopped (SIGSTOP or a debugger)) "
        "(EngineConfig.heartbeat_timeout_s=10.0); it is hung, stopped or gone" % HERE)
    assert late == []
    clock[0] = 1000.0
    lv, _ = make([ready(0)], {100: [ProcessSample(process_probe.GONE)] * 2})
    assert "rank 0 sent no heartbeat for 10.5s (host %s: its process has exited)" % HERE in lv.verdict(1010.5)


def test_a_starving_worker_is_late_until_the_late_limit(clock):
    # waiting on a run queue (its wait time grows), never stopped: late, reported once, then dead past the limit
    looks = [running(5, 10), running(5, 900, runnable=True)] + [running(6, 1000 * k) for k in range(2, 10)]
    lv, late = make([ready(0)], {100: looks}, late_limit_s=30.0)
    assert lv.verdict(1006.0) is None
    assert lv.verdict(1011.0) is None and late == [0]
    assert lv.verdict(1016.0) is None and late == [0]  # reported once per silence
    clock[0] = 1017.0
    lv.heard_from(0)  # it answers again: no longer late
    assert lv.verdict(1021.0) is None and lv.verdict(1023.0) is None  # then silent again
    assert lv.verdict(1028.0) is None and late == [0, 0]
    for t in (1033.0, 1038.0, 1043.0):
        assert lv.verdict(t) is None
    assert lv.verdict(1048.0) == (
        "worker rank 0 sent no heartbeat for 31.0s (host %s: its process runs, but late past "
        "EngineConfig.heartbeat_late_limit_s=30.0) (EngineConfig.heartbeat_timeout_s=10.0); it is hung, "
        "stopped or gone" % HERE)


def test_a_worker_sleeping_without_progress_or_on_another_host_is_dead_at_the_timeout(clock):
    lv, late = make([ready(0), ready(1, "elsewhere")], {100: [running(5, 5), running(5, 5)]})
    assert lv.verdict(1006.0) is None
    reason = lv.verdict(1011.0)
    assert reason.startswith(f"worker rank 0 sent no heartbeat for 11.0s (host {HERE}: its process sleeps without "
                             "running: stuck or cut off), rank 1 for 11.0s (host elsewhere) ")
    assert late == []


def test_the_masters_own_stall_is_not_the_workers_silence(clock, caplog):
    lv, _ = make([ready(0, "elsewhere")], {})
    assert lv.verdict(1004.0) is None
    assert lv.verdict(1012.0) is None  # the watchdog itself woke 8s late: 7.5s of it are forgiven
    assert "the master's watchdog woke 7.5s late" in caplog.text
    assert lv.verdict(1014.5) is None
    assert "rank 0 sent no heartbeat for 10.5s" in lv.verdict(1018.0)


def test_process_sign():
    assert process_sign(None, ProcessSample(process_probe.ZOMBIE)) == process_probe.EXITED
    assert process_sign(running(1, 1), running(1, 1)) == process_probe.SLEEPS
    assert process_sign(running(1, 1), running(2, 1)) == process_probe.RUNS
    assert process_sign(running(1, 1), running(1, 2)) == process_probe.RUNS
    assert process_sign(None, running(1, 1, runnable=True)) == process_probe.RUNS
    assert process_sign(None, running(1, 1)) == process_probe.SLEEPS


def test_process_probe_on_real_processes():
    me = process_probe.sample(os.getpid())
    assert me.state == process_probe.RUNNING and me.runnable and me.cpu_ns > 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        os.waitpid(child.pid, os.WUNTRACED)  # returns once it is stopped
        assert process_probe.sample(child.pid).state == process_probe.STOPPED
        os.kill(child.pid, signal.SIGCONT)
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)
    finally:
        child.kill()
    assert process_probe.sample(child.pid).state == process_probe.GONE
