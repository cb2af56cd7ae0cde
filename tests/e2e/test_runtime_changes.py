"""Model changes while serving, end to end: benchmarks/model_changes.py at tiny sizes (the path its full run
takes, so it cannot break unseen) and examples/runtime/models_and_adapters.py as the README runs it."""
import os
import subprocess
import sys

import pytest
from helpers import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_model_changes_benchmark_quick_path(tmp_path):
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "model_changes.py"), "--quick", "--dir", str(tmp_path))
    assert doc["benchmark"] == "model_changes" and len(doc["adds"]) == 1
    assert doc["steps_during_adds"] > 0 and doc["median_step_ms"] > 0
    assert doc["gap_ratio"] == pytest.approx(doc["max_gap_during_add_ms"] / doc["median_step_ms"])
    assert all(b > 0 for b in doc["adds"][0]["shard_bytes_per_rank"].values())


@pytest.mark.timeout(300)
def test_runtime_example_runs(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "runtime", "models_and_adapters.py"),
                          "--tp", "1", "--shape", "opt-tiny", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("added 'code' in") and "models: ['chat', 'code']" in lines[0]
    answers = {line.split()[0]: line.split("->")[1].strip() for line in lines[1:4]}
    assert set(answers) == {"chat", "chat-ft0", "chat-ft1"} and len(set(answers.values())) == 3
    assert "(version 2)" in lines[4] and lines[5].startswith("removed; still served: ['chat']")


@pytest.mark.timeout(600)
def test_lora_benchmark_quick_path(tmp_path):
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "lora.py"), "--quick", "--dir", str(tmp_path))
    assert doc["benchmark"] == "lora"
    for key in ("mixed_batch_tokens_per_s_ratio", "adapter_load_vs_base_load", "capacity_ratio"):
        assert doc[key] > 0, key
    a, m = doc["adapters_engine"], doc["merged_engine"]
    assert a["adapter_fills"] == doc["adapters"] and a["trace_loads"] == 0  # the base stays: no load at all
    assert m["trace_loads"] > 1 and a["rates"] and m["rates"]
    assert a["batch"] == doc["adapters"] and a["decode_step_batch_s"] > 0 and m["decode_step_1_s"] > 0
    if m["sustainable_rate"]:
        assert doc["rate_ratio_vs_merged"] == a["sustainable_rate"] / m["sustainable_rate"]
    grid = {float(x) for x in doc["rates_grid"].split(",")}
    for eng in (a, m):  # the grid walk, then bisections strictly between its last good and first bad rate
        ok = [r["rate"] for r in eng["rates"] if r["rate"] in grid and r["sustained"]]
        bad = [r["rate"] for r in eng["rates"]
               if r["rate"] in grid and not r["sustained"] and ok and r["rate"] > max(ok)]
        off_grid = [r["rate"] for r in eng["rates"] if r["rate"] not in grid]
        assert len(off_grid) == (doc["refine"] if ok and bad else 0) == (1 if ok and bad else 0)
        assert all(max(ok) < r < min(bad) for r in off_grid)
        assert eng["sustainable_rate"] == max((r["rate"] for r in eng["rates"] if r["sustained"]), default=0.0)
