"""benchmarks/swap_hygiene.py --quick through a live `computron serve` at PP=2: 300 swaps over two OPT and two
Llama checkpoints and a LoRA adapter, every answer its model's own, and the server's process tree flat: no
descriptor, open file, thread or child process more after the warm-up, memory within a loose bound (a model's
copy kept per swap would break it). The serve default that keeps the master's records bounded is checked
without a server."""
import os

import pytest
from helpers import run_main

from computron.server.config import SERVE_METRICS_HISTORY, parse_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOSE_MEMORY_BYTES = 64 << 20


@pytest.mark.timeout(600)
def test_300_swaps_through_serve_leave_the_process_tree_flat(tmp_path):
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "swap_hygiene.py"), "--quick", "--tp", "1", "--pp", "2",
                      "--dir", str(tmp_path))
    assert doc["measured_loads"] == doc["swaps"] == 300, doc  # every request swapped, none more
    assert doc["distinct_answers"] == len(doc["models"]) == 5, doc
    assert doc["leftover_processes"] == [], doc
    drift = doc["drift"]
    for key in ("fds", "open_files", "threads", "children"):
        assert drift[key]["drift"] == 0 and drift[key]["max_above_warmup"] == 0, (key, drift[key])
    assert drift["children"]["end"] >= 2, drift  # the two PP stages' workers were measured
    assert abs(drift["rss_bytes"]["drift"]) <= LOOSE_MEMORY_BYTES, drift["rss_bytes"]


def test_serve_keeps_a_bounded_metrics_history_unless_told_otherwise():
    engine, _, _ = parse_engine(None)
    assert engine.metrics_history == SERVE_METRICS_HISTORY == 2_000
    assert parse_engine({"metrics_history": 0})[0].metrics_history == 0
    assert parse_engine({"tp": 2, "metrics_history": 50})[0].metrics_history == 50
