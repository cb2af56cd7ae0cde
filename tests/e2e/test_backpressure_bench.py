"""benchmarks/backpressure.py --quick: a burst at a bounded queue through ``computron serve``; the rest refused
with 429, Retry-After and a counted reason."""
import os

import pytest

from helpers import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(400)
def test_backpressure_benchmark_quick_path():
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "backpressure.py"), "--quick")
    assert doc["benchmark"] == "backpressure" and doc["burst"] == 30 and doc["queue_size"] == 6
    assert set(doc["statuses"]) <= {"200", "429"}, doc["statuses"]
    assert doc["refused"] > 0 and doc["admitted"] >= doc["queue_size"], doc["statuses"]
    assert doc["refusals_without_retry_after"] == 0 and doc["retry_after_s"]["min"] >= 1
    assert doc["refusal_codes"] == ["queue_full"]
    assert doc["rejections"] == {"queue_full": doc["refused"], "ttft_late": 0}
    assert doc["refusal_master_ms"]["p50"] is not None  # every refusal says the server's time on it
