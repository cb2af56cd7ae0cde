"""A node cut off from its master leaves: TP=2 over the two namespaced nodes (``nodes.py``), the master on node 1
generating without pause, then node 2's link to the bridge cut silently. Every process of node 2 (its worker,
and the launcher's: the spawn parent and its fork server, or torchrun's agent) is gone within
2 x heartbeat_timeout_s + 10 s of the cut, in spawn and in attach (torchrun) mode, the worker saying why in one
ERROR line that names the silence and its length."""
import os
import re
import subprocess
import time

import psutil
import pytest
from conftest import VENV_BIN, node_env

from computron import zoo

HEARTBEAT_TIMEOUT_S = 5.0
GONE_WITHIN_S = 2 * HEARTBEAT_TIMEOUT_S + 10
SCRIPT = """
import asyncio, os, sys
from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
if __name__ == "__main__":
    path, node = sys.argv[1], int(sys.argv[2])
    config = EngineConfig(heartbeat_timeout_s=%(hb)s, master_host="node1", master_port=int(sys.argv[3]))
    models = [ModelConfig("lm", zoo.load_causal_lm, {"path": path})]
    nodes = {} if "RANK" in os.environ else {"n_nodes": 2, "node_rank": node}  # torchrun's, or spawn mode's
    engine = LaunchEngine(config, models, 2, 1, **nodes)
    if engine is not None:
        async def generate():
            print("serving", flush=True)
            while True:  # steps under way when the link is cut
                await engine.submit("lm", {"input_ids": [2, 5], "max_tokens": 64})
        asyncio.run(generate())
""" % {"hb": HEARTBEAT_TIMEOUT_S}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["spawn", "torchrun"])
def test_a_cut_off_node_leaves_within_twice_the_heartbeat_timeout(two_nodes, tmp_path, mode):
    script = tmp_path / "node.py"
    script.write_text(SCRIPT)
    path = zoo.save_random_causal_lm("opt-small", str(tmp_path / "ckpt"), seed=0)
    n1, n2 = two_nodes.nodes
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in (1, 2)]
    procs = []
    for i, n in enumerate((n1, n2)):
        port = {"spawn": "29517", "torchrun": "29518"}[mode]
        cmd = [os.path.join(VENV_BIN, "python"), str(script), path, str(i), port]
        if mode == "torchrun":
            cmd = [os.path.join(VENV_BIN, "torchrun"), "--nnodes", "2", "--node_rank", str(i), "--nproc_per_node",
                   "1", "--master_addr", n1.hostname, "--master_port", port, str(script), path, str(i), port]
        procs.append(two_nodes.popen(n, cmd, cwd=tmp_path, env=node_env(), stdout=subprocess.PIPE,
                                     stderr=logs[i], text=True))
    try:
        first = procs[0].stdout.readline()
        logs[0].seek(0)
        assert first.strip() == "serving", logs[0].read()[-3000:]
        node2 = [psutil.Process(p) for p in two_nodes.pids(n2)]
        assert len(node2) >= 2  # the worker and its launcher (and a fork server in spawn mode)
        t0 = time.monotonic()
        two_nodes.cut(n2)
        _, alive = psutil.wait_procs(node2, timeout=GONE_WITHIN_S + 30)
        gone_after = time.monotonic() - t0
        left = two_nodes.pids(n2)
        assert not alive and not left, (alive, left)
        print(f"{mode}: node 2's processes gone {gone_after:.1f}s after the cut")
        logs[1].seek(0)
        text = logs[1].read()
        assert gone_after <= GONE_WITHIN_S, (gone_after, text[-3000:])
        said = re.findall(r"ERROR: rank 1: the master is gone \((.*)\): exiting", text)
        assert len(said) == 1 and re.match(r"nothing heard from it for \d+\.\ds: ", said[0]), text[-3000:]
        assert "Traceback" not in text.split("ERROR: rank 1: the master is gone")[0], text[-3000:]
    finally:
        two_nodes.join(n2)
        two_nodes.kill_all(n1)
        two_nodes.kill_all(n2)
        for p in procs:
            p.wait(30)
        for f in logs:
            f.close()
