"""benchmarks/model_changes.py at tiny sizes (the path its full run takes, so it cannot break unseen)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_model_changes_benchmark_quick_path(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "model_changes.py"), "--quick",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-4000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    assert doc["benchmark"] == "model_changes" and len(doc["adds"]) == 1
    assert doc["steps_during_adds"] > 0 and doc["median_step_ms"] > 0
    assert doc["gap_ratio"] == pytest.approx(doc["max_gap_during_add_ms"] / doc["median_step_ms"])
    assert all(b > 0 for b in doc["adds"][0]["shard_bytes_per_rank"].values())
