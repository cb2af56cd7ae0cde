"""benchmarks/residency.py --quick: both eviction policies replay the same trace through real engines."""
import json
import os
import subprocess
import sys

import pytest

from helpers import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(480)
def test_residency_benchmark_quick_path():
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "residency.py"), "--quick")  # its engines: 2 child processes
    assert doc["benchmark"] == "residency"
    for key in ("bytes_moved_ratio", "ttft_p99_ratio", "targets", "sizes", "budget", "rates", "zipf"):
        assert key in doc, key
    sizes = doc["sizes"]
    assert max(sizes.values()) >= 3 * min(sizes.values())        # mixed sizes
    assert doc["budget"] < sum(sizes.values())                   # the models contend for the budget
    for policy in ("lru", "cost"):
        run_ = doc[policy]
        assert run_["requests"] == doc["requests"] and run_["errors"] == 0, (policy, run_)
        assert run_["loads"] > 0 and run_["bytes_loaded"] > 0
        assert run_["ttft_p99"] >= run_["ttft_p50"] > 0
    assert set(doc["targets"]) == {"bytes_moved_ratio", "ttft_p99_ratio"}


def _simulate(*args):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "residency_sim.py"), "--duration", "30",
                          *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_residency_simulator_replays_through_the_scheduler():
    """benchmarks/residency_sim.py: with half the bytes resident both policies reload models, every seed
    gives its ratios; the clairvoyant bound (--bounds) moves fewer bytes than LRU on every seed; with room
    for every model the warm-up's loads are the only ones, under both."""
    doc = _simulate("--seeds", "0-2", "--bounds")
    assert doc["seeds"] == [0, 1, 2] and len(doc["runs"]) == 3
    assert all(run[p]["loads"] > 0 and run[p]["bytes_loaded"] > 0 for run in doc["runs"] for p in ("lru", "cost"))
    assert doc["bytes_moved_ratio"]["of"] == 3 and doc["bytes_moved_ratio"]["min"] > 0
    assert set(doc["bounds"]) == {"rates", "belady"}
    for run in doc["runs"]:
        assert run["belady"]["bytes_loaded"] < run["lru"]["bytes_loaded"], run
        assert run["bounds"]["belady"]["bytes_moved_ratio"] == \
            round(run["belady"]["bytes_loaded"] / run["lru"]["bytes_loaded"], 3)
    assert doc["bounds"]["belady"]["bytes_moved_ratio"]["of"] == 3
    roomy = _simulate("--seeds", "0", "--budget-fraction", "1.05")
    assert all(roomy["runs"][0][p]["loads"] == 0 for p in ("lru", "cost")), roomy["runs"][0]
    assert "bytes_moved_ratio" not in roomy["runs"][0]
