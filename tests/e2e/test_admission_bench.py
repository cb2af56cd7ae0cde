"""benchmarks/admission.py --quick: admissions into a running batch, one forward or two, the same tokens."""
import os

import pytest

from helpers import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(240)
def test_admission_benchmark_quick_path():
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "admission.py"), "--quick")
    assert doc["benchmark"] == "admission" and doc["same_tokens"] is True
    assert set(doc["ways"]) == {"one", "apart", "auto"}
    for way, row in doc["ways"].items():
        assert row["admission_steps"] == doc["requests"], (way, row)  # each request joined the running batch
        assert row["step_s"] > 0 and row["request_s"] >= row["step_s"], (way, row)
    assert doc["admission_step_ratio"] > 0 and doc["apart_step_ratio"] > 0
