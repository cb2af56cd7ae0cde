"""The experiment scripts: Gamma arrivals, a short real sim run, and the plots."""
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXP = os.path.join(ROOT, "experiments")
sys.path.insert(0, EXP)

import workload  # noqa: E402
from helpers import run_main  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rate,cv", [(1.0, 0.25), (1.0, 1.0), (10.0, 4.0), (3.0, 2.0)])
def test_gamma_mean_and_cv(rate, cv):
    rng = np.random.default_rng(1234)
    duration = 200_000 / rate
    t = workload.gamma_arrivals(rate, cv, duration, rng)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert len(t) > 150_000
    assert np.all(gaps >= 0) and t[-1] < duration
    # standard error of the mean gap is cv/rate/sqrt(n) < 1% of 1/rate here; the CV's estimate wobbles more
    # for heavy-tailed CV 4, so the tolerances are 3% and 10%
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.10)
    assert len(t) / duration == pytest.approx(rate, rel=0.03)


@pytest.mark.timeout(300)
def test_trace_is_seeded_sorted_and_per_model():
    a = workload.make_trace((2, 1, 0.5), 1.0, 50.0, seed=7)
    b = workload.make_trace((2, 1, 0.5), 1.0, 50.0, seed=7)
    c = workload.make_trace((2, 1, 0.5), 1.0, 50.0, seed=8)
    assert a == b and a != c
    assert [x[0] for x in a] == sorted(x[0] for x in a)
    assert {m for _, m in a} == {"m0", "m1", "m2"}
    # a model's own arrivals do not depend on the other models' rates
    d = workload.make_trace((2, 5, 5), 1.0, 50.0, seed=7)
    assert [t for t, m in a if m == "m0"] == [t for t, m in d if m == "m0"]


@pytest.mark.timeout(300)
def test_config_table():
    assert len(workload.CONFIGS) == 19
    assert [c.cv for c in workload.CONFIGS[:3]] == [0.25, 1, 4]
    assert workload.CONFIGS[0].rates == (1, 1, 1) and workload.CONFIGS[17].rates == (10, 10, 10, 10, 1, 1)
    assert workload.CONFIGS[workload.SMOKE_CONFIG].rates == (2, 2)


def _experiments_status() -> dict:
    """Every file under experiments/ (bytecode caches left out) with its size and modification time: a run
    that wrote into experiments/data or experiments/figures changes it."""
    files = (p for p in pathlib.Path(EXP).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


@pytest.mark.timeout(300)
def test_short_sim_answers_every_request(tmp_path, monkeypatch):
    """The smoke run, from another directory and without --out: the JSON goes to results/sim/ there, and
    nothing under experiments/ changes."""
    before = _experiments_status()
    monkeypatch.chdir(tmp_path)
    _, err = run_main(os.path.join(EXP, "sim.py"), "-c", "18", "-d", "2", "--model", "opt-tiny", "--modes",
                      "ours,paper", "--seed", "3", "--max-tokens", "2", "--progress-every", "2", json_line=False)
    assert "answered" in err  # progress lines
    assert _experiments_status() == before
    out = tmp_path / "results" / "sim" / "sim_c18_opt-tiny.json"
    doc = json.loads(out.read_text())
    trace = doc["trace"]
    assert doc["config"]["n_requests"] == len(trace) > 0
    assert set(doc["records"]) == {"ours", "paper"}
    for mode, recs in doc["records"].items():
        assert [r["i"] for r in recs] == list(range(len(trace)))
        for r, (t, m) in zip(recs, trace):
            assert r["ok"], r
            assert r["model"] == m and r["arrival"] == pytest.approx(t)
            assert r["n_tokens"] is not None and 1 <= r["n_tokens"] <= 2
            assert r["batch_size"] >= 1 and r["latency"] > 0
            assert r["submit"] <= r["answer"]
        s = doc["summary"][mode]
        assert s["count"] == s["answered"] == len(trace) and s["errors"] == 0
        lat = sorted(r["latency"] for r in recs)
        assert s["mean"] == pytest.approx(float(np.mean(lat)))
        assert s["p50"] <= s["p99"] <= s["max"] == pytest.approx(lat[-1])
        assert s["slo_attainment"] == pytest.approx(sum(x <= s["slo"] for x in lat) / len(lat))
        # every request was batched once (request-level batches) or admitted once (token-level steps)
        eng = doc["engine_records"][mode]
        assert sum(b["batch_size"] for b in eng if b["kind"] == "batch") + \
            sum(b["admitted"] for b in eng if b["kind"] == "step") == len(trace)
    ratio = doc["summary"]["ours_over_paper"]
    assert ratio["mean"] == pytest.approx(doc["summary"]["ours"]["mean"] / doc["summary"]["paper"]["mean"])


def _synthetic_sim(cv, rates=(1, 1, 1), n=30, seed=0):
    rng = np.random.default_rng(seed)
    records = {m: [{"i": i, "model": f"m{i % len(rates)}", "ok": True, "latency": float(x)}
                   for i, x in enumerate(rng.gamma(2.0, scale, n))]
               for m, scale in (("ours", 0.05), ("paper", 0.2))}
    return {"kind": "sim", "records": records,
            "config": {"rates": list(rates), "cv": cv, "model": "opt-tiny", "tp_world_size": 1,
                       "pp_world_size": 1, "max_loaded": 1}}


def _synthetic_rr():
    summ = {m: {"offload": o, "load": ld, "model": 0.02, "overhead": 0.0005, "response": o + ld + 0.0205,
                "warmup_dropped": 2}
            for m, o, ld in (("ours", 0.001, 0.05), ("paper", 0.3, 0.2))}
    return {"kind": "round_robin", "records": {}, "summary": summ,
            "config": {"model_name": "opt-tiny", "num_models": 2, "tp_world_size": 1, "pp_world_size": 1,
                       "blocking": True, "max_tokens": 8}}


@pytest.mark.timeout(300)
def test_plot_writes_pngs(tmp_path):
    files = []
    for i, (cv, rates) in enumerate([(0.25, (1, 1, 1)), (1, (1, 1, 1)), (4, (10, 1, 1))]):
        p = tmp_path / f"sim{i}.json"
        p.write_text(json.dumps(_synthetic_sim(cv, rates, seed=i)))
        files.append(str(p))
    rr = tmp_path / "rr.json"
    rr.write_text(json.dumps(_synthetic_rr()))
    out_dir = tmp_path / "figs"
    proc = subprocess.run([sys.executable, os.path.join(EXP, "plot.py"), "--sim", *files, "--rr", str(rr),
                           "--out-dir", str(out_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("sim_cdf.png", "rr_breakdown.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.timeout(300)
def test_round_robin_attribution_sequential():
    """Blocking, one model at a time: offload -> load -> batch; overhead is what lies between them."""
    import round_robin
    from computron import BatchRecord, RequestRecord, SwapRecord

    metrics = [
        SwapRecord("load", "m0", 1.00, 1.10),
        BatchRecord("m0", 1.11, 1.20, 1, (0,), seq=2),
        RequestRecord(0, "m0", 1.00, 1.201, batch_uid=2),
        SwapRecord("offload", "m0", 2.00, 2.05),
        SwapRecord("load", "m1", 2.06, 2.16),
        BatchRecord("m1", 2.17, 2.30, 1, (1,), seq=5),
        RequestRecord(1, "m1", 2.00, 2.301, batch_uid=5),
    ]
    client = [{"i": 0, "model": "m0", "ok": True, "t_submit": 0.999, "t_answer": 1.202},
              {"i": 1, "model": "m1", "ok": True, "t_submit": 1.999, "t_answer": 2.302}]
    recs = round_robin.attribute(metrics, client)
    r = recs[1]
    assert r["offload"] == pytest.approx(0.05) and r["load"] == pytest.approx(0.10)
    assert r["model"] == pytest.approx(0.13)
    assert r["response"] == pytest.approx(0.303)
    assert r["overhead"] == pytest.approx(0.303 - 0.05 - 0.10 - 0.13)
    assert recs[0]["offload"] == 0 and recs[0]["load"] == pytest.approx(0.10)


@pytest.mark.timeout(300)
def test_round_robin_attribution_overlapped():
    """A batch that starts while its model loads: the union, not the sum, is busy time."""
    import round_robin
    from computron import BatchRecord, RequestRecord, SwapRecord

    metrics = [
        SwapRecord("offload", "m0", 2.00, 2.01),
        SwapRecord("load", "m1", 2.01, 2.10),
        BatchRecord("m1", 2.011, 2.20, 1, (0,), seq=1),
        RequestRecord(0, "m1", 2.00, 2.201, batch_uid=1),
    ]
    client = [{"i": 0, "model": "m1", "ok": True, "t_submit": 1.9995, "t_answer": 2.2015}]
    (r,) = round_robin.attribute(metrics, client)
    assert r["busy"] == pytest.approx(0.20)
    assert r["overhead"] == pytest.approx(0.002)
    assert r["response"] - r["load"] - r["model"] < r["overhead"]  # the plain formula goes wrong with overlap


def test_tables_print_units_and_no_ratio_of_a_difference():
    """Round-robin and sim tables name their units; resp-ld-md (a difference, negative for ours) gets no
    paper/ours ratio; every rr_breakdown panel shares one y scale."""
    import io
    import round_robin
    import sim
    doc = json.load(open(os.path.join(EXP, "data", "cpu", "rr_opt-125m_t1_p1.json")))
    out = io.StringIO()
    round_robin.print_table(doc["summary"], doc["config"]["modes"], file=out)
    text = out.getvalue()
    assert "mean milliseconds (ms) per request" in text and "ours ms" in text and "paper ms" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("resp-ld-md"))
    assert float(row.split()[1]) < 0 and row.split()[-1] == "-", row  # negative for ours, no ratio
    assert re.search(r"^response .* 2\.49x$", text, re.M), text
    assert "resp-ld-md = response - load - model" in text
    out = io.StringIO()
    sim.print_summary(json.load(open(os.path.join(EXP, "data", "cpu", "sim_c0_opt-125m.json"))), file=out)
    text = out.getvalue()
    for label in ("mean (s)", "p99 (s)", "max_late (s)", "slo<=1.0s (frac)", "max_late: how far"):
        assert label in text, text

    import matplotlib.pyplot as plt
    import plot
    seen = {}
    real_save = plot._save

    def keep(fig, axes, *a, **kw):
        seen["ylims"] = [ax.get_ylim() for ax in list(axes.flat)[:3]]
        plt.close(fig)
        return "x"
    plot._save = keep
    try:
        plot.plot_rr([json.load(open(os.path.join(EXP, "data", "cpu", f"rr_opt-125m_{c}.json")))
                      for c in ("t1_p1", "t2_p1", "t1_p2")], out_dir=".")
    finally:
        plot._save = real_save
    assert len(set(seen["ylims"])) == 1, seen


def test_round_robin_attribution_token_steps():
    """Token-level generation: a request's model time is its model's steps from submit to the step that
    answered it; the load belongs to the first of them."""
    import round_robin
    from computron.metrics import RequestRecord, StepRecord, SwapRecord

    metrics = [
        SwapRecord("offload", "m0", 2.00, 2.05),
        SwapRecord("load", "m1", 2.06, 2.16),
        StepRecord("m1", 2.17, 2.20, running=1, admitted=1, dropped=0, seq=6),
        StepRecord("m1", 2.21, 2.25, running=1, admitted=0, dropped=1, seq=7),
        RequestRecord(1, "m1", 2.00, 2.251, batch_uid=7),
    ]
    client = [{"i": 1, "model": "m1", "ok": True, "t_submit": 1.999, "t_answer": 2.252}]
    (r,) = round_robin.attribute(metrics, client)
    assert r["offload"] == pytest.approx(0.05) and r["load"] == pytest.approx(0.10)
    assert r["model"] == pytest.approx(0.07) and r["batch_size"] == 1
    assert r["overhead"] == pytest.approx(0.253 - 0.05 - 0.10 - 0.07)


@pytest.mark.timeout(300)
def test_llm_sim_and_generation_benchmark_cpu_paths(tmp_path):
    """The CPU-sized path of experiments/llm_sim.py (the GPU check's last step) and of
    benchmarks/generation.py: every mode answers every request, and the JSON carries the fields."""
    out = tmp_path / "llm.json"
    cmd = [os.path.join(EXP, "llm_sim.py"), "--model", "opt-tiny", "--configs", "18",
           "--duration", "1.5", "--rate-scale", "1", "--mean-tokens", "6", "--max-tokens-cap", "12",
           "--modes", "request,quantum,peer", "--bisect", "18", "--bisect-steps", "1", "--bisect-duration", "1.5",
           "--bisect-hi", "4", "--ttft-slo", "60",
           "--out", str(out), "--plot-dir", str(tmp_path)]
    line, _ = run_main(*cmd)
    doc = json.loads(out.read_text())
    assert {r["mode"] for r in doc["runs"]} == {"request", "quantum", "peer"}
    n = {r["requests"] for r in doc["runs"]}
    assert len(n) == 1 and n.pop() > 0  # the same trace for every mode
    assert all(r["errors"] == 0 and r["output_tokens"] > 0 and r["ttft_p99"] is not None for r in doc["runs"])
    assert set(doc["bisect"]["modes"]) == {"request", "quantum", "peer"}
    assert doc["sustainable_rate_ratio"] > 0 and doc["best_token_mode"] == "quantum"
    assert "c18_ml1" in doc["ttft_p99_ratio"]
    assert (tmp_path / "llm_sim_ttft_cdf.png").stat().st_size > 0
    assert line["experiment"] == "llm_sim"

    line, _ = run_main(os.path.join(ROOT, "benchmarks", "generation.py"), "--model", "opt-tiny", "--models", "2",
                       "--duration", "1.5", "--rate", "2", "--mean-tokens", "6")
    assert line["token"]["requests"] == line["request"]["requests"] > 0
    for key in ("ttft_p99_ratio", "tokens_per_s_ratio", "master_ms_per_step"):
        assert line[key] is not None and line[key] > 0


def _mixed_records():
    """A warm-up (load, batch, request of m0), then a trace of two requests where token-level m1 preempts m0
    (every kind of record in computron.metrics) and m0 comes back for a request-level batch."""
    from computron.metrics import (BatchRecord, KVRecord, PreemptionRecord, RequestRecord, StepRecord,
                                   SwapRecord)
    rt = {0: (0.0, 0.0)}
    warm = [SwapRecord("load", "m0", 0.0, 0.1, nbytes=10, device_bytes={0: 10}),
            BatchRecord("m0", 0.1, 0.2, 1, (0,), seq=1),
            RequestRecord(0, "m0", 0.0, 0.21, batch_uid=1)]
    trace = [PreemptionRecord("m0", 1.0, "m1", parked=1, recomputed=0),
             KVRecord("kv_offload", "m0", 1.0, 1.01, nbytes=4, rank_times=rt),
             SwapRecord("offload", "m0", 1.01, 1.02),
             SwapRecord("load", "m1", 1.02, 1.1, nbytes=10),
             StepRecord("m1", 1.1, 1.2, running=1, admitted=1, dropped=0, seq=10),
             StepRecord("m1", 1.2, 1.3, running=1, admitted=0, dropped=1, seq=11),
             RequestRecord(1, "m1", 1.0, 1.3, batch_uid=11, first_token=1.2, n_tokens=2),
             SwapRecord("offload", "m1", 1.3, 1.31),
             SwapRecord("load", "m0", 1.31, 1.4, nbytes=10),
             KVRecord("kv_restore", "m0", 1.4, 1.41, nbytes=4),
             BatchRecord("m0", 1.41, 1.6, 1, (2,), seq=12),
             RequestRecord(2, "m0", 1.05, 1.6, batch_uid=12)]
    client = [{"i": 0, "model": "m1", "ok": True, "error": None, "arrival": 0.0, "t_submit": 1.0,
               "t_answer": 1.301, "n_tokens": 2},
              {"i": 1, "model": "m0", "ok": True, "error": None, "arrival": 0.05, "t_submit": 1.05,
               "t_answer": 1.601, "n_tokens": 1}]
    return warm, trace, client


def test_every_record_kind_through_the_summaries():
    """Records of every kind (preemption and KV moves included) through sim.py's and round_robin.py's
    summaries, their JSON and computron.report: `sim.py -c 18` crashed on a PreemptionRecord."""
    import round_robin
    import sim
    from computron import report
    warm, trace, client = _mixed_records()
    res = sim.mode_result(client, warm + trace, len(warm), 1.0, n_warmup=1, slo=1.0)
    eng = json.loads(json.dumps(res["engine"]))
    assert [r["kind"] for r in eng] == [r.kind for r in trace]
    pre = next(r for r in eng if r["kind"] == "preemption")
    assert pre["at"] == pytest.approx(0.0) and pre["for_model"] == "m1" and pre["parked"] == 1
    assert next(r for r in eng if r["kind"] == "kv_offload")["rank_times"] == {"0": [-1.0, -1.0]}
    req = next(r for r in eng if r["kind"] == "request")
    assert req["submitted"] == pytest.approx(0.0) and req["first_token"] == pytest.approx(0.2)
    s = res["summary"]
    assert (s["count"], s["answered"], s["n_loads"], s["n_offloads"], s["n_batches"]) == (2, 2, 2, 2, 3)
    r0, r1 = res["records"]
    assert r0["batch_size"] == 1 and r0["queue"] == pytest.approx(0.1) and r0["batch"] == pytest.approx(0.1)
    assert r1["batch_size"] == 1 and r1["queue"] == pytest.approx(0.36)

    rr_client = [{"i": 0, "model": "m0", "ok": True, "t_submit": 0.0, "t_answer": 0.211}] + \
        [{k: c[k] for k in ("model", "ok", "t_submit", "t_answer")} | {"i": c["i"] + 1} for c in client]
    recs = round_robin.attribute(warm + trace, rr_client)
    assert [r["n_loads"] for r in recs] == [1, 1, 1]
    assert round_robin.summarize(recs, warmup=1)["n"] == 2
    json.dumps([workload.record_json(r) for r in warm + trace])
    assert "kv_offload" not in report.swap_table(warm + trace) and "request" in report.summary(warm + trace)


@pytest.mark.timeout(300)
def test_outputs_stay_out_of_the_tracked_results(tmp_path):
    """plot.py without --out-dir writes under results/ of the current directory; the tracked
    experiments/data and experiments/figures are written only with --publish (refused, exit 2, without)."""
    sim_json = tmp_path / "sim.json"
    sim_json.write_text(json.dumps(_synthetic_sim(1)))
    before = _experiments_status()
    proc = subprocess.run([sys.executable, os.path.join(EXP, "plot.py"), "--sim", str(sim_json)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "results" / "figures" / "sim_cdf.png").stat().st_size > 0
    for script, args in (("plot.py", ["--sim", str(sim_json), "--out-dir", os.path.join(EXP, "figures")]),
                         ("sim.py", ["--out", os.path.join(EXP, "data", "cpu", "new.json")]),
                         ("round_robin.py", ["--out", "experiments/data/cpu/new.json"]),
                         ("llm_sim.py", ["--plot-dir", "experiments/figures"])):
        proc = subprocess.run([sys.executable, os.path.join(EXP, script), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and "--publish" in proc.stderr, (script, proc.stderr)
    assert _experiments_status() == before


def test_llm_sim_refuses_an_empty_trace(monkeypatch, capsys):
    """The issue's --duration 10 --rate-scale 0.1 draws no request: exit 2 saying so and what to change,
    before any engine is launched."""
    import llm_sim

    def no_launch(*a, **kw):
        raise AssertionError("an engine was launched")
    monkeypatch.setattr(llm_sim, "launch", no_launch)
    for argv, knob in ((["--duration", "10", "--rate-scale", "0.1"], "--duration"),
                       (["--configs", "", "--bisect", "1", "--bisect-duration", "5", "--bisect-hi", "0.01"],
                        "--bisect-duration")):
        with pytest.raises(SystemExit) as exc:
            llm_sim.main(argv + ["--out", os.devnull])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "drew 0 requests" in err and knob in err, err


@pytest.mark.timeout(300)
def test_burst_and_preparation_benchmarks_cpu_paths(tmp_path):
    """benchmarks/burst.py and benchmarks/preparation.py at tiny sizes: both modes answer the whole burst, and
    the preparation run measures steps and heartbeats during its burst."""
    line, _ = run_main(os.path.join(ROOT, "benchmarks", "burst.py"), "--requests", "8", "--models", "2", "--tp", "1")
    assert line["token"]["requests"] == line["request"]["requests"] == 8
    assert line["token"]["errors"] == line["request"]["errors"] == 0
    assert line["requests_per_s_ratio"] > 0 and line["token"]["swaps"] > 0
    line, _ = run_main(os.path.join(ROOT, "benchmarks", "preparation.py"), "--burst", "8", "--chars", "300",
                       "--lm-tokens", "400", "--workdir", str(tmp_path))
    assert line["quiet_step_gap_ms_p50"] is not None and line["master_ms_per_step"] > 0


def _quick_benchmark(script: str) -> dict:
    """``benchmarks/<script> --quick`` as a command (its ranks are spawned processes): it exits 0 and prints
    exactly one JSON line, returned."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick"],
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout[-2000:]
    return json.loads(lines[0])


@pytest.mark.timeout(300)
def test_tp_forward_benchmark_quick_path():
    """benchmarks/tp_forward.py at opt-tiny, as a command (its ranks are spawned processes): every variant timed,
    the ratios are those of the decode times it reports."""
    doc = _quick_benchmark("tp_forward.py")
    assert doc["benchmark"] == "tp_forward" and doc["tp"] == 2 and doc["local_equals_dtensor"] is True
    for variant in ("local", "dtensor", "dtensor_inference_mode"):
        assert doc[variant]["prefill_s"] > 0 and set(doc[variant]["decode_s"]) == {"1", "8"}
    decode = {v: doc[v]["decode_s"]["1"] for v in ("local", "dtensor", "dtensor_inference_mode")}
    assert doc["dtensor_vs_local"] == pytest.approx(decode["dtensor"] / decode["local"])
    assert doc["inference_mode_vs_local"] == pytest.approx(decode["dtensor_inference_mode"] / decode["local"])


@pytest.mark.timeout(300)
def test_kv_park_benchmark_pool_moves_the_formula_plus_partial_blocks():
    """benchmarks/kv_park.py: the pool's park moves the sequences' KV bytes as the model's formula counts them,
    plus at most one partly filled block per sequence; the dynamic cache's padded rows move more."""
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "kv_park.py"), "--batch", "4", "--steps", "3")
    paged, dynamic = doc["paged"], doc["dynamic"]
    assert paged["tokens"] == dynamic["tokens"] == sum(doc["prompt_lengths"]) + 4 * 3
    per_token = paged["formula_bytes"] // paged["tokens"]
    assert paged["formula_bytes"] <= paged["moved_bytes"] < paged["formula_bytes"] + 4 * 16 * per_token
    longest = max(doc["prompt_lengths"]) + 3
    assert dynamic["moved_bytes"] >= 4 * (longest - 1) * per_token > paged["moved_bytes"]
    assert doc["paged_over_dynamic"] == pytest.approx(paged["moved_bytes"] / dynamic["moved_bytes"], abs=1e-3)


@pytest.mark.timeout(300)
def test_cpu_kernels_benchmark_quick_path():
    """benchmarks/cpu_kernels.py --quick: each built kernel timed against its torch operator at every case, the
    ratios those of the times, the matmul's verdict on this machine reported, the threads given back."""
    import torch
    from computron.kernels.cpu import attention as cpu_attention
    from computron.kernels.cpu import gemm as cpu_gemm
    before = torch.get_num_threads()
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "cpu_kernels.py"), "--quick")
    assert torch.get_num_threads() == before
    assert doc["bench"] == "cpu_kernels" and doc["quick"] is True and doc["repeats"] == 1
    cases = {"gemm": {f"{w}_rows{r}" for w in ("lm_head", "mlp") for r in (1, 8)} if cpu_gemm.built() else None,
             "attention": {"keys16"} if cpu_attention.available() else None}
    for kind, names in cases.items():
        if names is None:
            assert "not built" in doc[kind]
            continue
        assert set(doc[kind]) == names
        for c in doc[kind].values():
            assert c["kernel_ms"] > 0 and c["torch_ms"] > 0
            assert c["ratio"] == pytest.approx(c["kernel_ms"] / c["torch_ms"], rel=0.05)
    assert doc.get("gemm_verdict") == (cpu_gemm.available() if cpu_gemm.built() else None)


@pytest.mark.timeout(300)
def test_cpu_linear_benchmark_quick_path():
    """benchmarks/cpu_linear.py at opt-tiny: every form timed at each thread count and row count, the ratios are
    those of the times it reports, the swapped (weight-first and packed) Linears pick the plain ones' greedy
    tokens, and the script gives back the threads it set."""
    from computron.kernels.cpu.linear import packing_available
    import torch
    before = torch.get_num_threads()
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "cpu_linear.py"), "--quick")
    assert torch.get_num_threads() == before
    assert doc["benchmark"] == "cpu_linear" and doc["model"] == "opt-tiny" and doc["linears"] > 0
    assert set(doc["chain"]) == {"1", "2"} and all(set(c) == {"1", "8"} for c in doc["chain"].values())
    for per_rows in doc["chain"].values():
        for c in per_rows.values():
            assert c["f_linear"] > 0 and c["ratio"] == pytest.approx(c["weight_first"] / c["f_linear"])
            assert c["read_once"] > 0
            assert ("packed_ratio" in c) == packing_available()
            if packing_available():
                assert c["packed_ratio"] == pytest.approx(c["packed"] / c["f_linear"])
    dec = doc["decode"]
    assert dec["threads"] == 2 and dec["same_tokens"] is True
    for batch in ("1", str(dec["batch"])):
        row = dec[batch]
        for name in ("weight_first", "packed"):
            assert row[f"{name}_step_ratio"] == pytest.approx(row[name]["step_ms"] / row["f_linear"]["step_ms"])


@pytest.mark.timeout(300)
def test_vocab_split_benchmark_quick_path():
    """benchmarks/vocab_split.py: at TP=2 a rank's shard holds half the embedding and LM head (the bytes a swap
    moves), where whole copies would make it nearly the TP=1 shard."""
    doc = _quick_benchmark("vocab_split.py")
    assert doc["benchmark"] == "vocab_split" and doc["tp"] == 2
    assert doc["embed_share_moved"] == pytest.approx(0.5, abs=0.01)
    assert doc["tp_shard_bytes"] < doc["tp_replicated_bytes"] and doc["tp1_shard_bytes"] > doc["tp_shard_bytes"]
