"""An engine group on Ray whose node is cut off from the front leaves: ``computron serve --ray --groups 2`` over a
Ray head on node 1 and a Ray worker node on node 2 (``nodes.py``), node 2's link cut silently; the group actor's
process on node 2 and every process it started (its engine's workers, their fork server) are gone within
2 x heartbeat_timeout_s + 10 s of the cut (the front's keepalive pings stopped reaching it). Ray's own daemons
are Ray's business."""
import json
import os
import subprocess
import time

import psutil
import pytest
from conftest import VENV_BIN, LogLines, node_env, ray_start
from serve_helpers import write_checkpoints

pytest.importorskip("ray", reason="Ray is not installed (pip install -e .[ray])")

HEARTBEAT_TIMEOUT_S = 5.0
GONE_WITHIN_S = 2 * HEARTBEAT_TIMEOUT_S + 10


def group_family(two_nodes, node):
    """The group actor's process on ``node`` and everything it started."""
    actors = []
    for pid in two_nodes.pids(node):
        try:
            p = psutil.Process(pid)
            if "EngineGroup" in " ".join(p.cmdline()):
                actors.append(p)
        except psutil.NoSuchProcess:
            pass
    return actors + [c for a in actors for c in a.children(recursive=True)]


@pytest.mark.timeout(420)
def test_a_cut_off_group_stops_its_engine_and_leaves(two_nodes, tmp_path):
    n1, n2 = two_nodes.nodes
    ckpts = write_checkpoints(str(tmp_path / "ckpt"), n=1)
    ray_start(two_nodes, n1)
    ray_start(two_nodes, n2, head=n1.addr)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"models": [{"id": m, "path": p} for m, p in ckpts.items()],
                               "engine": {"max_loaded": 1, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S},
                               "server": {"host": "0.0.0.0", "port": 8000}}))
    proc = two_nodes.popen(n1, [os.path.join(VENV_BIN, "computron"), "serve", "--config", str(cfg), "--ray",
                                "--groups", "2", "--ray-address", f"{n1.addr}:6379"],
                           env=node_env(COMPUTRON_GROUP_KEEPALIVE_TIMEOUT_S="3"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    log = LogLines(proc.stdout)
    try:
        log.wait_for(r"serving .* on http://", timeout=300)
        family = group_family(two_nodes, n2)
        assert len(family) >= 2, [p.cmdline() for p in family]  # the actor and its workers
        t0 = time.monotonic()
        two_nodes.cut(n2)
        _, alive = psutil.wait_procs(family, timeout=GONE_WITHIN_S + 30)
        gone_after = time.monotonic() - t0
        print(f"ray group: node 2's group processes gone {gone_after:.1f}s after the cut")
        assert not alive and gone_after <= GONE_WITHIN_S, (alive, gone_after)
    finally:
        two_nodes.join(n2)
        proc.kill()
        proc.wait(30)
