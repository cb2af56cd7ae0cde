"""experiments/cluster_run.py at a tiny size, then cluster_sim.py --validate on what it wrote: the real
multi-group run the simulator is validated against keeps working, and leaves no process behind."""
import json
import os
import subprocess
import sys

import psutil
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e .[ray]): the cluster tier needs it")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(420)
def test_cluster_run_feeds_the_simulator_validation(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "run.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "cluster_run.py"), "--model", "opt-tiny",
                          "--models", "3", "--duration", "6", "--rate", "3", "--mean-tokens", "4", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["groups"] == 2 and doc["policy"] == "swap_aware" and doc["models"] == ["m0", "m1", "m2"]
    n = len(doc["trace"]["arrivals"])
    assert n > 0 and len(doc["latencies_s"]) == n
    assert 0 < doc["mean_latency_s"] <= doc["p99_latency_s"]
    assert doc["costs"]["step_s"] > 0 and doc["costs"]["load_host_s"] > 0
    check = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "cluster_sim.py"), "--validate",
                            str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-4000:]
    val = json.loads(check.stdout.strip().splitlines()[-1])
    assert val["predicted"]["requests"] == n
    assert val["ratio"]["mean_latency_s"] > 0 and val["ratio"]["p99_latency_s"] > 0
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=30)
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
