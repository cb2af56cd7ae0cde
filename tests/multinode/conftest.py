"""The multinode tier: two nodes made of network namespaces on this machine (``nodes.py``), for the module.

Skipped, saying why, where they cannot be made (not root, no ``ip`` or ``unshare``). The processes the tests
start live in the nodes' namespaces and some outlive a test (Ray's daemons, ``computron serve``), so the root
conftest's per-test leak check is replaced by the fixture's own at teardown: every process in the namespaces
killed, the namespaces, links and /etc/netns entries removed, and all of it checked gone.
"""
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest
from helpers import command_env

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nodes import TwoNodes, missing  # noqa: E402

VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Per test: nothing (see the module docstring); ``two_nodes`` checks at its teardown."""
    yield


@pytest.fixture(scope="module")
def two_nodes():
    why = missing()
    if why:
        pytest.skip(f"two namespaced nodes cannot be made here: {why}")
    nodes = TwoNodes()
    try:
        nodes.create()
        yield nodes
    finally:
        left = nodes.destroy()
        shutil.rmtree(f"/tmp/{nodes.prefix}", ignore_errors=True)
        assert not left, f"the two nodes left {left} behind"


def node_env(**extra) -> dict:
    """A command's environment on a node: the checkout importable, one thread per op, Ray without its
    token (the nodes have no route out) and without usage stats."""
    return command_env(OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)


class LogLines:
    """A process's output lines, read by a thread; ``wait_for(pattern)`` blocks until a line (not seen by an
    earlier wait) matches, or the timeout passes (then it fails, quoting the tail)."""

    def __init__(self, stream):
        self.lines, self._next = [], 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # EOF
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> str:
        rx = re.compile(pattern)

        def found():
            for i in range(self._next, len(self.lines)):
                if self.lines[i] is None or rx.search(self.lines[i]):
                    return i
            return None
        with self._cond:
            assert self._cond.wait_for(lambda: found() is not None, timeout), \
                f"no line matching {pattern!r} within {timeout}s; last lines:\n" + self.tail()
            i = found()
            assert self.lines[i] is not None, f"the process ended before {pattern!r}; last lines:\n" + self.tail()
            self._next = i + 1
            return self.lines[i]

    def tail(self, n: int = 40) -> str:
        return "\n".join(ln for ln in self.lines[-n:] if ln is not None)


def ray_start(nodes: TwoNodes, node, head=None) -> None:
    """``ray start`` on ``node``: the head (``head`` None) or a worker node joining ``head``'s address; 2
    logical CPUs each, so that one group (1 worker + its master) fills a node."""
    args = [os.path.join(VENV_BIN, "ray"), "start", f"--node-ip-address={node.addr}", "--num-cpus=2",
            "--object-store-memory=100000000", f"--temp-dir=/tmp/{nodes.prefix}/ray{node.index}",
            "--disable-usage-stats"]
    args += ["--head", "--port=6379", "--include-dashboard=false"] if head is None else [f"--address={head}:6379"]
    r = nodes.run(node, args, timeout=180, env=node_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def curl(nodes: TwoNodes, node, url: str, body=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """One HTTP request from ``node`` (curl in its namespace)."""
    import json
    args = ["curl", "-sS", "--max-time", str(int(timeout)), url]
    if body is not None:
        args += ["-H", "content-type: application/json", "-d", json.dumps(body)]
    return nodes.run(node, args, timeout=timeout + 30)
