"""experiments/cluster_sim.py: the quick run end to end (a subprocess), predict() and --validate."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXP = os.path.join(ROOT, "experiments")
sys.path.insert(0, EXP)

import cluster_sim  # noqa: E402


def _run(*args, timeout=300):
    proc = subprocess.run([sys.executable, os.path.join(EXP, "cluster_sim.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout  # one JSON line on stdout, progress on stderr
    return json.loads(lines[0])


@pytest.mark.timeout(600)
def test_quick_run_answers_every_request_and_reports_the_keys(tmp_path):
    out = tmp_path / "sim.json"
    doc = _run("--quick", "--out", str(out), "--plot-dir", str(tmp_path))
    for key in ("groups_needed", "groups_needed_by_slo", "groups_needed_ratio_vs_ray_mux",
                "groups_needed_ratio_vs_ray_mux_by_slo", "curves", "router_us_per_route", "slos"):
        assert key in doc, key
    assert set(doc["groups_needed"]) == set(cluster_sim.POLICIES)
    assert doc["curves"]
    for curve in doc["curves"]:
        assert set(curve["attainment"]) == set(cluster_sim.POLICIES)
        for pol, ys in curve["attainment"].items():
            assert len(ys) == len(curve["rates"]) and all(0.0 <= y <= 1.0 for y in ys), (pol, ys)
            assert curve["unanswered"][pol] == [0] * len(ys)  # every request answered
    for g in doc["groups_needed"].values():
        assert g is None or 1 <= g <= 16
    ratio = doc["groups_needed_ratio_vs_ray_mux"]
    assert ratio is None or ratio > 0
    assert doc["router_us_per_route"] > 0  # measured, never asserted against a bound here
    assert (tmp_path / "cluster_sim_attainment.png").stat().st_size > 0
    full = json.loads(out.read_text())
    assert full["needed"]["swap_aware"]["probes"]


def test_predict_and_validate_round_trip(tmp_path):
    rates = cluster_sim.zipf_rates(4, 2.0, 1.0)
    arrivals = cluster_sim.make_requests(rates, 1.0, 20.0, seed=3)
    trace = {"arrivals": arrivals, "warmup_s": 0}
    pred = cluster_sim.predict(trace, "cpu-opt-125m", 2, "swap_aware")
    assert pred["requests"] == len(arrivals) and pred["mean_latency_s"] > 0
    assert pred["p99_latency_s"] >= pred["mean_latency_s"]
    again = cluster_sim.predict(trace, cluster_sim.load_costs("cpu-opt-125m").to_json(), 2, "swap_aware")
    assert again == pred  # deterministic, and costs given as a name or as fields alike
    measured = {"groups": 2, "models": sorted(rates), "policy": "swap_aware", "trace": trace, "costs": "cpu-opt-125m",
                "mean_latency_s": pred["mean_latency_s"] * 1.1, "p99_latency_s": pred["p99_latency_s"]}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(measured))
    doc = _run("--validate", str(path))
    assert doc["ratio"]["mean_latency_s"] == pytest.approx(1 / 1.1)
    assert doc["ratio"]["p99_latency_s"] == pytest.approx(1.0)
    assert doc["within_25pct"] is True


def test_refuses_to_write_into_the_tracked_results_without_publish(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(EXP, "cluster_sim.py"), "--quick", "--out",
                           os.path.join(EXP, "data", "cluster_sim_test.json")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--publish" in proc.stderr
    assert not os.path.exists(os.path.join(EXP, "data", "cluster_sim_test.json"))
