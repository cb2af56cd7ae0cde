"""docs/cluster.md's two-node recipe as written (its set-up, its ``on`` helper, its removal), under a name prefix
and subnet of this run's own: the nodes reach each other by name, each under its own host name, and the
removal leaves nothing behind."""
import os
import re
import subprocess

import pytest
from nodes import TwoNodes, missing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "<!-- not run: needs root (network namespaces) -->"


def recipe_blocks():
    text = open(os.path.join(ROOT, "docs", "cluster.md")).read()
    return re.findall(re.escape(MARK) + r"\n```bash\n(.*?)```", text, re.S)


@pytest.mark.timeout(120)
def test_the_docs_two_node_recipe():
    why = missing()
    if why:
        pytest.skip(f"two namespaced nodes cannot be made here: {why}")
    setup, run, down = recipe_blocks()
    assert setup.startswith("P=cn; S=0\n") and run.startswith("on() {")
    nodes = TwoNodes()  # only for its names and its check of what is left
    first = f"P={nodes.prefix}; S={nodes.subnet}\n"
    probe = ('on 1 hostname; on 2 hostname; on 2 getent hosts node1\n'
             'on 1 python3 -c "import socket; print(socket.gethostbyname(socket.gethostname()))"\n'
             'on 2 python3 -c "import socket; socket.create_connection((\'node1\', 22), 3)" 2>&1 | tail -1\n')
    script = first + setup[len("P=cn; S=0\n"):] + run.splitlines()[0] + "\n" + probe
    try:
        r = subprocess.run(["bash", "-ec", script], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert lines[:2] == ["node1", "node2"]
        assert lines[2].split() == [f"10.200.{nodes.subnet}.1", "node1"]
        assert lines[3] == f"10.200.{nodes.subnet}.1"  # a node's own name is its address, not loopback
        assert "ConnectionRefusedError" in lines[4]  # node 1 answered (nothing listens on 22): a route, no drop
    finally:
        r = subprocess.run(["bash", "-ec", first + down], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not nodes.leftovers(), nodes.leftovers()
