"""``computron serve --ray --groups 2`` over a Ray head on node 1 and a Ray worker node on node 2 (namespaced
nodes, ``nodes.py``): one group per node, answers from either node equal to transformers' greedy ones; a
silent partition of node 2 takes its group out of routing (the front's keepalive); node 2's raylet killed
while requests are under way: they are answered by group on node 1, and the group is back once the node
rejoins; SIGTERM drains the front. The tests run in this order, over one cluster and one server."""
import functools
import json
import os
import subprocess
import time

import pytest
from conftest import VENV_BIN, LogLines, curl, node_env, ray_start
from helpers import greedy_reference, rest_of_output
from serve_helpers import write_checkpoints
from transformers import AutoTokenizer

pytest.importorskip("ray", reason="Ray is not installed (pip install -e .[ray])")
pytestmark = pytest.mark.timeout(420)

N = 8  # tokens per answer
PROMPT = "The engine swaps models"
KEEPALIVE_TIMEOUT_S = 3
GROUP_OF_NODE = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
pgs = ray.util.placement_group_table().values()
print(json.dumps({int(p["name"].rsplit("-", 1)[1]): ips.get(p["bundles_to_node_id"].get(0))
                  for p in pgs if p["name"].startswith("computron-group-") and p["state"] == "CREATED"}))
"""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return write_checkpoints(str(tmp_path_factory.mktemp("multinode-ckpt")), n=4)


@functools.lru_cache(maxsize=None)
def reference(path, prompt=PROMPT, n=N):
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tok.decode(greedy_reference(path, tok(prompt)["input_ids"], n).tolist(), skip_special_tokens=True)


@pytest.fixture(scope="module")
def server(two_nodes, ckpts, tmp_path_factory):
    """Ray head on node 1, a Ray worker node on node 2, ``computron serve --ray --groups 2`` on node 1."""
    n1, n2 = two_nodes.nodes
    ray_start(two_nodes, n1)
    ray_start(two_nodes, n2, head=n1.addr)
    cfg = tmp_path_factory.mktemp("multinode-serve") / "serve.yaml"
    cfg.write_text(json.dumps({"models": [{"id": m, "path": p} for m, p in ckpts.items()],
                               "engine": {"max_loaded": 1, "heartbeat_timeout_s": 60},
                               "server": {"host": "0.0.0.0", "port": 8000, "drain_s": 60}}))
    proc = two_nodes.popen(n1, [os.path.join(VENV_BIN, "computron"), "serve", "--config", str(cfg), "--ray",
                                "--groups", "2", "--ray-address", f"{n1.addr}:6379"],
                           env=node_env(COMPUTRON_GROUP_KEEPALIVE_TIMEOUT_S=str(KEEPALIVE_TIMEOUT_S)),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = LogLines(proc.stdout)
    log.wait_for(r"serving .* on http://", timeout=300)
    yield proc, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def ask(two_nodes, node, model, ckpts=None, n=N):
    r = curl(two_nodes, node, "http://node1:8000/v1/completions",
             {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["choices"][0]["text"]


def status(two_nodes, node):
    r = curl(two_nodes, node, "http://node1:8000/api/status")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def group_nodes(two_nodes):
    n1 = two_nodes.nodes[0]
    r = two_nodes.run(n1, [os.path.join(VENV_BIN, "python"), "-c", GROUP_OF_NODE, f"{n1.addr}:6379"], timeout=120,
                      env=node_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def test_one_group_per_node_answers_from_either_node(two_nodes, server, ckpts):
    n1, n2 = two_nodes.nodes
    assert sorted(group_nodes(two_nodes).values()) == [n1.addr, n2.addr]
    for i, m in enumerate(sorted(ckpts)):  # asked from node 1 and from node 2 in turn
        assert ask(two_nodes, (n1, n2)[i % 2], m) == reference(ckpts[m])
    st = status(two_nodes, n2)
    assert [g["alive"] for g in st["groups"]] == [True, True]
    # both groups served: each holds a model on its device (max_loaded 1)
    holding = {int(g) for row in st["models"] for g, r in (row["groups"] or {}).items() if r == "resident"}
    assert holding == {0, 1}, st


def test_silent_partition_stops_requests_to_the_cut_off_group(two_nodes, server, ckpts):
    proc, log = server
    n1, n2 = two_nodes.nodes
    cut_group = next(g for g, ip in group_nodes(two_nodes).items() if ip == n2.addr)
    t0 = time.monotonic()
    two_nodes.cut(n2)
    try:
        line = log.wait_for(rf"engine group {cut_group} is down", timeout=120)
        detected = time.monotonic() - t0
        print(f"partition noticed in {detected:.1f}s: {line}")
        assert "noticed by the front's keepalive" in line, line  # not by Ray's own health checks
        for m in sorted(ckpts):  # each answered, on node 1's group
            assert ask(two_nodes, n1, m) == reference(ckpts[m])
        assert [g["alive"] for g in status(two_nodes, n1)["groups"]] == [g != cut_group for g in (0, 1)]
    finally:
        two_nodes.join(n2)
    log.wait_for(rf"engine group {cut_group} is back", timeout=180)


def test_raylet_killed_mid_request_retried_on_the_other_group_then_back(two_nodes, server, ckpts):
    proc, log = server
    n1, n2 = two_nodes.nodes
    lost = next(g for g, ip in group_nodes(two_nodes).items() if ip == n2.addr)
    models = sorted(ckpts)
    # 8 greedy requests (2 per model) under way from node 1, then node 2's raylet is killed
    def one(i, m):
        body = json.dumps({"model": m, "prompt": PROMPT, "max_tokens": 32, "temperature": 0})
        return (f"curl -sS --max-time 300 http://node1:8000/v1/completions -H 'content-type: application/json' "
                f"-d '{body}' > /tmp/{two_nodes.prefix}/answer{i}.json")
    script = " & ".join(one(i, m) for i, m in enumerate(models * 2))
    os.makedirs(f"/tmp/{two_nodes.prefix}", exist_ok=True)
    clients = two_nodes.popen(n1, ["sh", "-c", script + " & wait"])
    # under way: the groups report them waiting or running (each status read is one curl, no sleep)
    deadline = time.monotonic() + 120
    while sum(r["waiting"] + r["running"] for r in status(two_nodes, n1)["models"]) == 0:
        assert clients.poll() is None and time.monotonic() < deadline, "the requests never showed up as under way"
    raylet = [p for p in two_nodes.pids(n2) if b"raylet/raylet" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(raylet) == 1
    os.kill(raylet[0], 9)
    assert clients.wait(360) == 0
    for i, m in enumerate(models * 2):
        text = json.load(open(f"/tmp/{two_nodes.prefix}/answer{i}.json"))["choices"][0]["text"]
        assert text == reference(ckpts[m], n=32)
    log.wait_for(rf"engine group {lost} is down", timeout=120)
    # the node comes back (rebooted: what ran there is gone), and the group with it
    two_nodes.kill_all(n2)
    ray_start(two_nodes, n2, head=n1.addr)
    log.wait_for(rf"engine group {lost} is back \(restart", timeout=300)
    assert [g["alive"] for g in status(two_nodes, n2)["groups"]] == [True, True]
    for m in models:
        assert ask(two_nodes, n2, m) == reference(ckpts[m])


def test_sigterm_drains_the_front(two_nodes, server, ckpts):
    proc, log = server
    n1, n2 = two_nodes.nodes
    m = sorted(ckpts)[0]
    body = json.dumps({"model": m, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True})
    stream = two_nodes.popen(n2, ["curl", "-sSN", "--max-time", "300", "http://node1:8000/v1/completions",
                                  "-H", "content-type: application/json", "-d", body],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = stream.stdout.readline()
    assert first.startswith("data: "), first + stream.stderr.read()
    proc.terminate()  # SIGTERM
    rest, err = rest_of_output(stream, timeout=300)  # not communicate(): it would lose what readline buffered
    chunks = [json.loads(ln[len("data: "):]) for ln in (first + rest).splitlines()
              if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert rest.rstrip().endswith("data: [DONE]"), rest + err
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference(ckpts[m], n=48)
    assert proc.wait(120) == 0, log.tail()
    log.wait_for(r"draining", timeout=10)
    log.wait_for(r"stopped", timeout=10)
