"""A worker's watchdog on its master (``worker.master_watch``): the policy on a clock of the test's own, the
thread on a fake clock too (a condition it waits on is woken by the test, never by time passing)."""
import queue
import re
import threading

from computron.comm import process_probe
from computron.comm.process_probe import ProcessSample
from computron.config import EngineConfig
from computron.worker.master_watch import MasterSilence, MasterWatch

RUNNING = ProcessSample(process_probe.RUNNING, 5, 5, runnable=True)


def silence(master_pid=None, looks=()):
    looks = list(looks)
    s = MasterSilence(timeout_s=20.0, late_limit_s=60.0, now=1000.0, master_pid=master_pid,
                      probe=lambda pid: looks.pop(0), start_s=300.0)
    s.heard(1000.0)  # the master's first keepalive
    return s


def test_a_master_still_starting_gets_the_start_timeout_until_it_first_speaks():
    s = MasterSilence(timeout_s=20.0, late_limit_s=60.0, now=1000.0, start_s=300.0)
    assert s.first_due() == 1300.0  # its own workers may still be building their shards
    why, _ = s.check(1300.0, 1300.0)
    assert why == ("nothing heard from it for 300.0s: no command, no keepalive, no heartbeat taken (not once "
                   "since this process began serving; EngineConfig.start_timeout_s=300)")
    s = MasterSilence(timeout_s=20.0, late_limit_s=60.0, now=1000.0, start_s=300.0)
    s.heard(1290.0)
    assert s.check(1300.0, 1300.0) == (None, 1310.0)  # once heard from, the master timeout
    assert s.check(1310.0, 1310.0)[0].endswith("for 20.0s: no command, no keepalive, no heartbeat taken "
                                               "(EngineConfig.master_timeout_s=20)")


def test_the_deadline_moves_with_every_contact_and_passes_after_the_timeout():
    s = silence()
    assert s.first_due() == 1020.0
    s.heard(1007.0)  # a heartbeat the master took, in the middle of a long command
    assert s.check(1020.0, 1020.0) == (None, 1027.0)
    s.heard(1026.0)
    s.heard(1003.0)  # a contact reported late never moves the deadline back
    assert s.check(1027.0, 1027.0) == (None, 1046.0)
    why, _ = s.check(1046.3, 1046.0)
    assert why == ("nothing heard from it for 20.3s: no command, no keepalive, no heartbeat taken "
                   "(EngineConfig.master_timeout_s=20)")


def test_this_workers_own_stall_is_not_the_masters_silence():
    s = silence()
    # due at 1020 but run at 1035 (this process had no CPU): the master gets half the timeout to be heard from
    assert s.check(1035.0, 1020.0) == (None, 1045.0)
    assert s.check(1045.0, 1045.0)[0].startswith("nothing heard from it for 20.0s")
    s = silence()
    assert s.check(1029.0, 1020.0)[0] is not None  # 9 s late is within half the timeout: counted


def test_a_local_master_that_runs_is_late_and_a_stopped_one_gone():
    s = silence(master_pid=42, looks=[RUNNING] * 20)
    assert s.first_due() == 1010.0  # a first look at half the timeout
    due = 1010.0
    why, due = s.check(due, due)
    assert (why, due) == (None, 1020.0)
    seen = []
    while due <= 1060.0:  # late: given up to heartbeat_late_limit_s, looked at every quarter timeout
        why, due = s.check(due, due)
        seen.append(due)
        if why is not None:
            break
    assert why is None and seen == [1025.0, 1030.0, 1035.0, 1040.0, 1045.0, 1050.0, 1055.0, 1060.0, 1065.0]
    why, _ = s.check(1065.0, 1065.0)
    assert why.endswith("(EngineConfig.master_timeout_s=20); its process runs") and "for 65.0s" in why
    s = silence(master_pid=42, looks=[RUNNING, ProcessSample(process_probe.STOPPED, 5, 5)])
    assert s.check(1010.0, 1010.0) == (None, 1020.0)
    assert s.check(1020.0, 1020.0)[0].endswith("; its process stopped")


def test_a_late_master_heard_again_is_forgiven():
    s = silence(master_pid=42, looks=[RUNNING] * 3)
    s.check(1010.0, 1010.0)
    assert s.check(1020.0, 1020.0) == (None, 1025.0)
    s.heard(1024.0)
    assert s.check(1025.0, 1025.0) == (None, 1034.0)  # a first look again at half the timeout


def test_the_default_timeout_is_twice_the_heartbeat_timeout():
    assert EngineConfig(heartbeat_timeout_s=7.0).resolved_master_timeout_s() == 14.0
    assert EngineConfig(heartbeat_timeout_s=7.0, master_timeout_s=3.0).resolved_master_timeout_s() == 3.0


class FakeClock:
    """Time the test moves (``to``), waking the watch's condition so that it looks at the new time; ``to``
    returns once the watch thread read the clock again (it then holds the condition's lock until it sleeps, so
    the test's next step finds it asleep)."""

    def __init__(self):
        self.now = 1000.0
        self.watch = None
        self.read = threading.Event()

    def __call__(self):
        if threading.current_thread().name.startswith("computron-master-watch"):
            self.read.set()
        return self.now

    def to(self, t):
        with self.watch._cond:
            self.read.clear()
            self.now = t
            self.watch._cond.notify_all()
        assert self.read.wait(60)


class Recorded(MasterSilence):
    """The policy, telling the test about each check it made (the thread's only way to act)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.checks = queue.Queue()

    def check(self, now, due):
        out = super().check(now, due)
        self.checks.put((now, out))
        return out


def run_watch(start_s=None):
    clock = FakeClock()
    gone = []
    policy = Recorded(20.0, 60.0, clock(), None, process_probe.sample, "no command", start_s)
    watch = clock.watch = MasterWatch(3, policy, on_gone=lambda rank, why: gone.append((rank, why)), clock=clock)
    thread = watch.start()
    assert clock.read.wait(60)  # asleep until its first deadline
    return clock, watch, policy, gone, thread


def test_the_watch_thread_sleeps_until_the_deadline_that_contacts_moved():
    clock, watch, policy, gone, thread = run_watch()
    clock.now = 1005.0
    watch.heard()  # the first contact: the thread plans its deadline again (1025)
    clock.to(1019.0)  # before the deadline: back to sleep without a check
    clock.now = 1019.0
    watch.heard()  # moves the deadline to 1039 without waking the thread
    clock.to(1025.0)
    assert policy.checks.get(timeout=60) == (1025.0, (None, 1039.0))
    clock.to(1039.5)
    now, (why, _) = policy.checks.get(timeout=60)
    thread.join(60)
    assert not thread.is_alive() and now == 1039.5 and policy.checks.empty()
    assert gone == [(3, "nothing heard from it for 20.5s: no command (EngineConfig.master_timeout_s=20)")]


def test_the_first_contact_shortens_the_sleeping_threads_deadline_to_the_master_timeout():
    clock, watch, policy, gone, thread = run_watch(start_s=300.0)
    clock.now = 1005.0
    watch.heard()  # asleep until 1300 (the start timeout) so far: now until 1025
    clock.to(1025.5)
    now, (why, _) = policy.checks.get(timeout=60)
    thread.join(60)
    assert now == 1025.5 and gone == [(3, "nothing heard from it for 20.5s: no command "
                                           "(EngineConfig.master_timeout_s=20)")]


def test_a_stopped_watch_says_nothing():
    clock = FakeClock()
    gone = []
    watch = MasterWatch(3, MasterSilence(20.0, 60.0, clock()), on_gone=lambda r, w: gone.append(w), clock=clock)
    thread = watch.start()
    watch.stop()
    clock.now = 2000.0
    thread.join(60)
    assert not thread.is_alive() and gone == []


def test_a_broken_connection_says_why_in_one_line():
    gone = []
    watch = MasterWatch(3, MasterSilence(20.0, 60.0, 0.0), on_gone=lambda rank, why: gone.append((rank, why)))
    watch.broken(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:1234\nmore"))
    assert gone == [(3, "its connection broke: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection "
                        "closed by peer [10.0.0.1]:1234")]


def test_an_engine_group_cut_off_from_the_front_stops_its_engine_and_leaves(monkeypatch):
    """A group on Ray arms its watchdog at the front's first keepalive ping; silence past the timeout stops its
    engine (its workers) and ends the actor's process, saying why."""
    import asyncio

    from computron.cluster.groups import EngineGroup
    from computron.worker import master_watch

    left = queue.Queue()
    monkeypatch.setattr(master_watch, "exit_master_gone",
                        lambda group, why, cleanup, who: left.put((group, why, cleanup, who)))

    class Engine:
        closed = False

        def close(self):
            self.closed = True
    group = EngineGroup.__new__(EngineGroup)
    group.group, group.incarnation, group._closing = 1, "abc", False
    group._front_watch, group._master_timeout_s, group.engine = None, 0.2, Engine()
    assert asyncio.run(group.ping()) == "abc"
    assert asyncio.run(group.ping()) == "abc"  # heard again: the deadline moves
    number, why, cleanup, who = left.get(timeout=60)
    assert (number, who) == (1, "group") and group._closing
    assert re.fullmatch(r"nothing heard from it for \d+\.\ds: no keepalive ping from the front "
                        r"\(EngineConfig.master_timeout_s=0.2\)", why), why
    cleanup()
    assert group.engine.closed
