"""A worker's watchdog on its master (``worker.master_watch``), on a clock and processes of the test's own."""
import pytest

from computron.comm import process_probe
from computron.comm.process_probe import ProcessSample
from computron.worker import master_watch
from computron.worker.master_watch import MasterWatch


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(master_watch, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    return now


def watch(master_pid=None, looks=()):
    gone = []
    looks = list(looks)
    w = MasterWatch(3, timeout_s=10.0, late_limit_s=30.0, interval_s=0.5, master_pid=master_pid,
                    probe=lambda pid: looks.pop(0), on_gone=lambda rank, why: gone.append((rank, why)))
    return w, gone


def test_a_silent_master_is_gone_after_the_timeout_while_waiting_only(clock):
    w, _ = watch()
    assert w.verdict(1050.0) is None  # executing a command: the master is not expected to speak
    w.waiting()
    for t in (1004.0, 1008.0):
        assert w.verdict(t) is None
    w.heard()  # a keepalive
    clock[0] = 1009.0
    w.waiting()
    assert w.verdict(1013.0) is None and w.verdict(1017.0) is None
    assert w.verdict(1019.5) == ("nothing from it, not even a keepalive, for 10.5s while waiting for a command "
                                 "(EngineConfig.master_timeout_s=10.0)")


def test_this_workers_own_stall_is_not_the_masters_silence(clock):
    w, _ = watch()
    w.waiting()
    assert w.verdict(1004.0) is None
    assert w.verdict(1012.0) is None  # woke 8s late: this process had no CPU
    assert w.verdict(1016.0) is None
    assert "for 10.5s" in w.verdict(1018.0)


def test_a_local_master_that_runs_is_late_and_a_stopped_one_gone(clock):
    running = ProcessSample(process_probe.RUNNING, 5, 5, runnable=True)
    w, _ = watch(master_pid=42, looks=[running] * 10)
    w.waiting()
    for t in (1006.0, 1011.0, 1015.0, 1019.0, 1023.0, 1027.0, 1030.0):
        assert w.verdict(t) is None  # late: waits up to heartbeat_late_limit_s
    assert w.verdict(1031.0).endswith("(EngineConfig.master_timeout_s=10.0); its process runs")
    w, _ = watch(master_pid=42, looks=[running, ProcessSample(process_probe.STOPPED, 5, 5)])
    w.waiting()
    assert w.verdict(1006.0) is None
    assert w.verdict(1011.0).endswith("(EngineConfig.master_timeout_s=10.0); its process stopped")


def test_a_broken_connection_says_why_in_one_line():
    w, gone = watch()
    w.broken(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:1234\nmore"))
    assert gone == [(3, "its connection broke: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection "
                        "closed by peer [10.0.0.1]:1234")]
