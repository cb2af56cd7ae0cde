"""benchmarks/tiers.py and the disk-tier step of benchmarks/gpu_check.sh, at CPU size: every figure the
README quotes is measured (start-up and the disk tier against their floors, beyond_memory with a tiny
total against a tiny budget) and the GPU script's disk rows run as they would on a GPU."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIERS = os.path.join(ROOT, "benchmarks", "tiers.py")


def _run(args, timeout=420, **env):
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.timeout(450)
def test_tiers_benchmark_cpu_path(tmp_path):
    """Start-up against its floor and disk-tier loads against bare processes reading the same bytes."""
    proc = _run([sys.executable, TIERS, "--model", "opt-tiny", "--dtype", "float32", "--models", "3",
                 "--host-models", "1", "--rounds", "1", "--startup-reps", "1", "--dir", str(tmp_path)])
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["loads_disk"] > 0 and line["loads_host"] > 0, line
    for key in ("startup_vs_floor", "startup_s", "floor_import_s", "floor_read_s", "startup_cpu_vs_floor",
                "disk_vs_concurrent_read", "disk_gbps", "concurrent_read_gbps", "swap_s_disk"):
        assert line[key] > 0, (key, line)
    assert line["slice_bytes_per_rank"][0] <= line["span_bytes_per_rank"][0]
    assert set(line["targets"]) == {"startup_vs_floor<=1.3", "disk_vs_concurrent_read>=0.9"}


@pytest.mark.timeout(450)
def test_beyond_memory_cpu_path(tmp_path):
    """Every model answers what transformers' generate answers (references cached beside the
    checkpoints), loads come from disk, and every process's peak RSS is measured against its budget."""
    args = [sys.executable, TIERS, "--only", "beyond", "--dtype", "float32", "--beyond-model", "opt-tiny",
            "--beyond-vocab", "512", "--beyond-models", "3", "--beyond-host-models", "1", "--beyond-rounds", "1",
            "--dir", str(tmp_path)]
    beyond = json.loads(_run(args).stdout.strip().splitlines()[-1])["beyond_memory"]
    assert beyond["all_correct"] and not beyond["wrong"] and beyond["requests"] == 3, beyond
    assert beyond["rss_ok"] and set(beyond["peak_rss_bytes"]) == {"master", "rank0", "rank1"}, beyond
    assert beyond["loads_disk"] >= 2 and all(d["loads"] == 1 for d in beyond["per_model"].values()), beyond
    assert not beyond["exceeds_memory"] and not beyond["passed"]  # a tiny total: the logic, not the claim
    assert os.path.isfile(tmp_path / "reference.json")


@pytest.mark.timeout(450)
def test_gpu_check_disk_rows_cpu_path(tmp_path):
    """`STEPS=disk bash benchmarks/gpu_check.sh`, the disk-tier rows, with opt-tiny on the CPU: every load
    from disk, cold and warm, each paired with a bare read."""
    _run(["bash", "benchmarks/gpu_check.sh"], STEPS="disk", TIERS_MODELS="opt-tiny", TIERS_DIR=str(tmp_path / "c"),
         OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    rows = [json.loads(x) for x in (tmp_path / "out" / "gpu_results.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["model"] == "opt-tiny" and rows[0]["tp"] == 1, rows
    for cache in ("cold", "warm"):
        assert rows[0][f"loads_disk_{cache}"] >= 2 and rows[0][f"loads_host_{cache}"] == 0, rows
        assert rows[0][f"disk_vs_concurrent_read_{cache}"] > 0, rows
