"""The decode step of benchmarks/gpu_check.sh at CPU size: `STEPS=decode` with llama-tiny on the CPU runs
benchmarks/decode_step.py eager against compiled (inductor here, CUDA graphs on the GPU), both KV layouts,
and writes its one row."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(600)
def test_gpu_check_decode_row_cpu_path(tmp_path):
    env = {**os.environ, "STEPS": "decode", "DECODE_DEVICE": "cpu", "DECODE_MODEL": "llama-tiny",
           "DECODE_BATCH": "3", "DECODE_STEPS": "4", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=580, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "gpu_results.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["bench"] == "decode_step" and rows[0]["compile"] == "on", rows
    for kind in ("dynamic", "paged"):
        row = rows[0][kind]
        assert row["eager_ms"] > 0 and row["compiled_ms"] > 0 and not row["fell_back"], row
        assert row["first_pass_s"] > 0, row
        assert row["compiled_over_eager"] == pytest.approx(row["compiled_ms"] / row["eager_ms"], abs=2e-3), row
