"""Simulated workload: Gamma-process arrivals per model (the paper's ``experiments/sim.py``).

One arrival trace ``(time, model)`` is drawn from ``--seed`` for configuration
``-c`` (the table is in ``workload.py``) and replayed, unchanged, against our
engine and then against paper mode (``EngineConfig(paper_mode=True)``), each
in its own engine launched in turn. Before the trace starts, every model gets
one warm-up request, one after the other (as in the paper); those are not
recorded. The client is an asyncio dispatcher that sleeps until each arrival
time and then starts a task that awaits ``engine.submit``.

Per request: ``latency`` = answer - submit on the master's clock (the client
submits on time unless the machine is overloaded; ``late`` = submit - scheduled
arrival records by how much it did not). Per mode: count, mean, p50, p99
latency, SLO attainment (fraction of the trace answered within ``--slo``
seconds), and the engine's swap counts; with both modes, the ratios ours/paper
of mean and p99. Progress goes to stderr every ``--progress-every`` answers.

The JSON goes to ``results/sim/`` (git-ignored) unless ``--out`` names another file; the tracked
``experiments/data`` needs ``--publish``. A trace that draws no request is refused (exit 2) before any launch.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time
from typing import List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402


async def replay(engine, trace: Sequence[Tuple[float, str]], payload: dict, mode: str,
                 progress_every: int, timeout=None) -> Tuple[List[dict], float]:
    """Submit each request of ``trace`` at its time; return the client records and the start time."""
    t_start = time.perf_counter()
    progress = workload.Progress(mode, len(trace), progress_every)

    async def one(i, t, mid):
        rec = {"i": i, "model": mid, "arrival": t, "ok": True, "error": None}
        rec["t_submit"] = time.perf_counter()
        try:
            out = await engine.submit(mid, payload, timeout=timeout)
            rec["n_tokens"] = int(out.numel())
        except Exception as exc:  # noqa: BLE001 - recorded; the replay goes on
            rec["ok"], rec["error"] = False, f"{type(exc).__name__}: {exc}"
        rec["t_answer"] = time.perf_counter()
        progress.tick()
        return rec

    tasks = []
    for i, (t, mid) in enumerate(trace):
        delay = t_start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # the workload generator waits for the next arrival
        tasks.append(asyncio.create_task(one(i, t, mid)))
    return list(await asyncio.gather(*tasks)), t_start


def _first_work(metrics: Sequence, rec, last):
    """The first batch (or token-level step) of the request's model that ran for it."""
    if last.kind == "batch":
        return last
    return min((m for m in metrics if m.kind == "step" and m.model_id == rec.model_id
                and m.start >= rec.submitted and m.end <= last.end), key=lambda m: m.start, default=last)


def build_records(client: Sequence[dict], metrics: Sequence, t_start: float, n_warmup: int) -> List[dict]:
    reqs = sorted((r for r in metrics if r.kind == "request"), key=lambda r: r.uid)[n_warmup:]
    by_submit = sorted(client, key=lambda c: c["t_submit"])
    batch_of_seq = {b.seq: b for b in metrics if b.kind in ("batch", "step")}  # step: token-level generation
    if len(reqs) != len(by_submit):
        raise RuntimeError(f"engine recorded {len(reqs)} requests, the client sent {len(by_submit)}")
    out = []
    for rec, c in zip(reqs, by_submit):
        if rec.model_id != c["model"]:
            raise RuntimeError(f"request order mismatch at engine uid {rec.uid}")
        b = batch_of_seq.get(rec.batch_uid) if rec.batch_uid is not None else None
        out.append({
            "i": c["i"], "uid": rec.uid, "model": c["model"], "ok": c["ok"], "error": c["error"],
            "n_tokens": c.get("n_tokens"),
            "arrival": c["arrival"], "submit": c["t_submit"] - t_start, "answer": c["t_answer"] - t_start,
            "late": c["t_submit"] - t_start - c["arrival"],
            "latency": c["t_answer"] - c["t_submit"],
            "engine_latency": rec.latency,
            "batch_size": (b.batch_size if b.kind == "batch" else b.running) if b is not None else None,
            "queue": (_first_work(metrics, rec, b).start - rec.submitted) if b is not None else None,
            "batch": b.duration if b is not None else None,
        })
    out.sort(key=lambda r: r["i"])
    return out


def summarize(records: Sequence[dict], metrics: Sequence, slo: float) -> dict:
    ok = [r["latency"] for r in records if r["ok"]]
    loads = [m for m in metrics if m.kind == "load"]
    offs = [m for m in metrics if m.kind == "offload"]
    batches = [m for m in metrics if m.kind in ("batch", "step")]
    return {
        "count": len(records), "answered": len(ok), "errors": len(records) - len(ok),
        "mean": workload.mean(ok), "p50": workload.percentile(ok, 50), "p99": workload.percentile(ok, 99),
        "max": max(ok) if ok else None,
        "slo": slo, "slo_attainment": (sum(1 for x in ok if x <= slo) / len(records)) if records else None,
        "max_late": max((r["late"] for r in records), default=None),
        "n_loads": len(loads), "n_offloads": len(offs), "n_batches": len(batches),
        "mean_batch_size": workload.mean([b.batch_size if b.kind == "batch" else b.running for b in batches]),
        "load_s_mean": workload.mean([m.duration for m in loads]),
        "offload_s_mean": workload.mean([m.duration for m in offs]),
        "batch_s_mean": workload.mean([m.duration for m in batches]),
    }


def run_mode(mode: str, trace, args, model_ids: List[str]) -> dict:
    engine, launch_s = workload.launch_opt(mode, args.model, len(model_ids), args.max_loaded_resolved, args)
    load_before = os.getloadavg()
    res = asyncio.run(_drive(engine, mode, trace, args, model_ids))
    return {**res, "launch_s": launch_s, "loadavg": [load_before[0], os.getloadavg()[0]]}


async def _drive(engine, mode: str, trace, args, model_ids: List[str]) -> dict:
    """Warm-up, then the trace, on ``engine`` (closed at the end)."""
    payload = {"input_ids": workload.make_prompt(args.model), "max_tokens": args.max_tokens}
    async with engine:
        for mid in model_ids:  # warm-up, one model after the other
            await engine.submit(mid, payload)
        n_warm_metrics = len(engine.metrics())
        client, t_start = await replay(engine, trace, payload, mode, args.progress_every, args.timeout)
        wall = time.perf_counter() - t_start
        metrics = engine.metrics()
    return {**mode_result(client, metrics, n_warm_metrics, t_start, len(model_ids), args.slo), "wall_s": wall}


def mode_result(client: Sequence[dict], metrics: Sequence, n_warm_metrics: int, t_start: float, n_warmup: int,
                slo: float) -> dict:
    """One mode's per-request records, summary and engine records (every kind, as JSON) from the client's
    records and ``engine.metrics()``; the first ``n_warm_metrics`` engine records are the warm-up's."""
    records = build_records(client, metrics, t_start, n_warmup)
    trace_metrics = metrics[n_warm_metrics:]
    return {"records": records, "summary": summarize(records, trace_metrics, slo),
            "engine": [workload.record_json(m, t_start) for m in trace_metrics]}


def _fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


SUMMARY_ROWS = (  # key, label with its unit, scale
    ("answered", "answered (req)", None), ("errors", "errors (req)", None),
    ("mean", "mean (s)", 1.0), ("p50", "p50 (s)", 1.0), ("p99", "p99 (s)", 1.0),
    ("slo_attainment", None, 1.0), ("n_loads", "loads (count)", None),
    ("mean_batch_size", "batch (req)", 1.0), ("max_late", "max_late (s)", 1.0),
)


def print_summary(doc: dict, file=sys.stdout) -> None:
    c = doc["config"]
    print(f"config {c['config']}: {c['label']} (x{c['rate_scale']}), {c['model']} tp={c['tp_world_size']} "
          f"pp={c['pp_world_size']} b={c['batch_size']} max_loaded={c['max_loaded']} d={c['duration']}s "
          f"seed={c['seed']}: {c['n_requests']} requests", file=file)
    modes = [m for m in ("ours", "paper") if m in doc["summary"]]
    print(f"{'':<18}" + "".join(f"{m:>10}" for m in modes), file=file)
    for k, label, _ in SUMMARY_ROWS:
        vals = [doc["summary"][m][k] for m in modes]
        name = f"slo<={c['slo']}s (frac)" if k == "slo_attainment" else label
        print(f"{name:<18}" + "".join(f"{(str(v) if isinstance(v, int) else _fmt(v)):>10}" for v in vals),
              file=file)
    print("latencies: submit to answer; slo: fraction of the trace answered within the SLO; batch: mean "
          "requests per batch; max_late: how far the client's submit fell behind its scheduled arrival at worst "
          "(near 0 unless the machine was overloaded)", file=file)
    r = doc["summary"].get("ours_over_paper")
    if r:
        print(f"ours/paper: mean {_fmt(r['mean'])}x  p99 {_fmt(r['p99'])}x", file=file)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-c", "--config", type=int, default=0,
                    help=f"index into workload.CONFIGS (0..{len(workload.CONFIGS) - 1})")
    ap.add_argument("-t", "--tp-world-size", type=int, default=1)
    ap.add_argument("-p", "--pp-world-size", type=int, default=1)
    ap.add_argument("-b", "--batch-size", type=int, default=8, help="CausalLMBatchManager max_batch_size")
    ap.add_argument("-d", "--duration", type=float, default=30.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="opt-tiny", help="a computron.zoo shape name")
    ap.add_argument("--max-loaded", default="1", help="an int, or 'paper' for the configuration's own")
    ap.add_argument("--max-tokens", type=int, default=1, help="new tokens per request (the paper's sim: 1)")
    ap.add_argument("--slo", type=float, default=1.0, help="latency objective in seconds")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiply every rate (lighter CPU runs)")
    ap.add_argument("--modes", default="ours,paper", help="comma-separated: ours, paper")
    ap.add_argument("--dtype", default=None, help="float32/float16/bfloat16 (default: float16 on GPU, else float32)")
    ap.add_argument("--no-overlap", action="store_true", help="ablation: EngineConfig(overlap=False) for ours")
    ap.add_argument("--no-prefetch", action="store_true", help="ablation: EngineConfig(prefetch=False) for ours")
    ap.add_argument("--pack-cpu-linears", default="pinned", choices=("pinned", "true", "false"),
                    help="EngineConfig.pack_cpu_linears (CPU; 'true' packs each model's Linears after every load)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads per worker (EngineConfig.worker_threads; 0: automatic)")
    ap.add_argument("--timeout", type=float, default=None, help="per-request timeout in seconds (default none)")
    ap.add_argument("--progress-every", type=int, default=50)
    ap.add_argument("--out", default=None,
                    help="JSON file to write (default: results/sim/sim_c<config>_<model>[_x<scale>].json)")
    workload.add_publish_arg(ap)
    args = ap.parse_args(argv)
    if not 0 <= args.config < len(workload.CONFIGS):
        ap.error(f"-c {args.config}: must be in 0..{len(workload.CONFIGS) - 1}")
    if args.rate_scale <= 0:
        ap.error("--rate-scale must be > 0")
    args.out = args.out or workload.results_path(
        "sim", f"sim_c{args.config}_{args.model}{'' if args.rate_scale == 1 else f'_x{args.rate_scale:g}'}.json")
    workload.check_outputs(ap, args.publish, args.out)
    sc = workload.CONFIGS[args.config]
    args.max_loaded_resolved = sc.paper_max_loaded if args.max_loaded == "paper" else int(args.max_loaded)
    args.dtype = args.dtype or workload.default_dtype()
    try:
        modes = workload.parse_modes(args.modes)
    except ValueError as exc:
        ap.error(str(exc))

    rates = tuple(r * args.rate_scale for r in sc.rates)
    model_ids = [f"m{i}" for i in range(sc.n_models)]
    trace = workload.make_trace(rates, sc.cv, args.duration, args.seed, model_ids)
    print(f"config {args.config}: {sc.label()} x{args.rate_scale}: {len(trace)} requests over {args.duration}s",
          file=sys.stderr, flush=True)
    workload.check_trace(ap, trace, f"config {args.config}", rates, args.duration)

    records, summary, timing, engine_records = {}, {}, {}, {}
    for mode in modes:
        print(f"[{mode}] launching {sc.n_models} x {args.model}", file=sys.stderr, flush=True)
        res = run_mode(mode, trace, args, model_ids)
        records[mode], summary[mode] = res["records"], res["summary"]
        timing[mode] = {"launch_s": res["launch_s"], "wall_s": res["wall_s"], "loadavg_1min": res["loadavg"]}
        engine_records[mode] = res["engine"]
    if "ours" in summary and "paper" in summary:
        summary["ours_over_paper"] = {
            k: (summary["ours"][k] / summary["paper"][k] if summary["paper"][k] else None) for k in ("mean", "p99")}
    config = {k: v for k, v in vars(args).items() if k not in ("out", "publish", "max_loaded_resolved")}
    config.update(max_loaded=args.max_loaded_resolved, paper_max_loaded=sc.paper_max_loaded,
                  rates=list(rates), base_rates=list(sc.rates), cv=sc.cv, label=sc.label(), modes=modes,
                  n_requests=len(trace), date=datetime.datetime.now().isoformat(timespec="seconds"),
                  machine=workload.machine_info(),
                  command=" ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])))
    doc = {"kind": "sim", "config": config, "trace": [[t, m] for t, m in trace], "records": records,
           "summary": summary, "timing": timing, "engine_records": engine_records}
    workload.write_json(args.out, doc)  # first: the run is kept even if printing fails
    print_summary(doc)
    return doc


if __name__ == "__main__":
    main()
