"""A measured multi-group run, for ``cluster_sim.py --validate``: a Zipf trace served by engine groups on Ray.

    .venv/bin/python experiments/cluster_run.py                       # 2 groups x 4 opt-small, 120 s at 2 req/s
    .venv/bin/python experiments/cluster_run.py --router round-robin --out results/cluster_run/rr.json
    .venv/bin/python experiments/cluster_sim.py --validate results/cluster_run/cluster_run.json

``--groups`` groups (``computron.cluster``: one engine of TP=1 per Ray actor, ``max_loaded`` models resident
each) all serve ``--models`` random causal LMs of zoo shape ``--model`` (EOS switched off, so every request
generates exactly its ``max_tokens``). Arrivals: one Gamma process per model (``workload.gamma_arrivals``, CV
``--cv``), the total rate ``--rate`` split Zipf-wise (model i gets a share proportional to 1 / (i + 1) **
``--zipf``), seeded; prompts of 8-64 random tokens, outputs lognormal of mean ``--mean-tokens`` (capped at
4x). Before the trace every group serves each model once (warm-up, not counted). Each request is submitted
at its arrival time through the ``ClusterEngine`` (non-streamed); its latency is submit to answer.

Output (``--out``, default ``results/cluster_run/cluster_run.json``), ``cluster_sim.py``'s validation format:
``groups``, ``models``, ``policy``, ``trace`` ({"arrivals": [[t_s, model, prompt_tokens, max_tokens], ...],
"warmup_s": 0}), ``mean_latency_s``, ``p99_latency_s``, and ``costs`` fitted from the groups' own records
during the trace: ``step_s`` + ``step_per_seq_s`` (least squares over decode-only steps: duration against
running sequences), ``prefill_per_token_s`` (what steps that admitted sequences took beyond that fit, per
admitted prompt token, at the trace's mean prompt length), ``load_host_s`` / ``offload_s`` (medians of the
loads and offloads), ``model_bytes``. Besides: every request's latency, loads per group, the machine and
its load average (the figures depend on what else runs on it).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import workload  # noqa: E402


def make_trace(models, rate, zipf, cv, duration, mean_tokens, vocab, seed):
    """``[(t, model, prompt_ids, max_tokens)]`` sorted by time."""
    rng = np.random.default_rng(seed)
    shares = np.array([1.0 / (i + 1) ** zipf for i in range(len(models))])
    shares /= shares.sum()
    out = []
    for m, share in zip(models, shares):
        for t in workload.gamma_arrivals(rate * share, cv, duration, rng):
            n_prompt = int(rng.integers(8, 65))
            sigma = 0.6
            n_new = int(min(4 * mean_tokens, max(1, round(rng.lognormal(np.log(mean_tokens) - sigma ** 2 / 2, sigma)))))
            out.append((float(t), m, [2] + [int(x) for x in rng.integers(4, vocab, n_prompt - 1)], n_new))
    return sorted(out, key=lambda a: a[0])


def fit_costs(records, mean_prompt: float, max_loaded: int, n_models: int, max_batch: int, name: str) -> dict:
    steps = [r for r in records if r.kind == "step" and not r.error]
    dec = [(r.running - 1, r.end - r.start) for r in steps if r.admitted == 0 and r.running > 0]
    x, y = np.array([d[0] for d in dec], float), np.array([d[1] for d in dec], float)
    if len(set(x.tolist())) > 1:
        per_seq, base = np.polyfit(x, y, 1)
    else:
        per_seq, base = 0.0, float(np.median(y)) if len(y) else 0.0
    admit = [r for r in steps if r.admitted > 0]
    extra = sum((r.end - r.start) - (base + per_seq * (r.running - 1)) for r in admit)
    prefill = max(0.0, float(extra) / max(1.0, sum(r.admitted for r in admit) * mean_prompt))
    loads = [r for r in records if r.kind == "load" and not r.error]
    offloads = [r for r in records if r.kind == "offload" and not r.error]
    load_s = float(np.median([r.end - r.start for r in loads])) if loads else 0.0
    src = f"cluster_run.py: {len(dec)} decode-only steps, {len(admit)} admitting steps, {len(loads)} loads"
    return {"name": name, "step_s": max(1e-5, float(base)), "step_per_seq_s": max(0.0, float(per_seq)),
            "prefill_per_token_s": prefill, "load_host_s": load_s,
            "load_disk_s": load_s,  # every model stays in the groups' host memory: no disk load happens
            "model_bytes": int(np.median([r.nbytes for r in loads])) if loads else 0,
            "max_loaded": max_loaded, "host_models": n_models, "max_batch": max_batch, "ttft_slo_s": 2.0,
            "mux_load_s": 0.0, "offload_s": float(np.median([r.end - r.start for r in offloads])) if offloads else 0.0,
            "source": {"step_s": src, "step_per_seq_s": src, "prefill_per_token_s": src, "load_host_s": src,
                       "load_disk_s": "= load_host_s (no disk tier in this run)"}}


def trace_arguments(ap: argparse.ArgumentParser, model: str, duration: float, duration_help: str) -> None:
    """The groups, models and trace options this experiment and ``cluster_trace.py`` share."""
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--models", type=int, default=4)
    ap.add_argument("--model", default=model, help=f"zoo shape of every model (default {model})")
    ap.add_argument("--max-loaded", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second, all models together")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--cv", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=duration, help=duration_help)
    ap.add_argument("--mean-tokens", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=0)


def models_trace_and_ray(args):
    """``(model ids, their ModelConfigs, the trace, whether Ray was started here)`` of ``trace_arguments``'
    options: ``--models`` random ``--model`` LMs, one trace over them, and Ray joined or started."""
    from computron import ModelConfig, zoo
    from computron.batching.causal_lm import CausalLMBatchManager
    from computron.cluster.serve import init_ray
    hf = zoo.hf_config(args.model)
    models = [f"m{i}" for i in range(args.models)]
    bm = CausalLMBatchManager(max_batch_size=args.max_batch, pad_token_id=hf.pad_token_id, eos_token_id=None,
                              vocab_size=hf.vocab_size, max_positions=hf.max_position_embeddings)
    configs = [ModelConfig(m, zoo.random_causal_lm, {"name": args.model, "seed": i, "fast_init": True},
                           batch_manager=bm) for i, m in enumerate(models)]
    trace = make_trace(models, args.rate, args.zipf, args.cv, args.duration, args.mean_tokens, hf.vocab_size,
                       args.seed)
    started_ray = init_ray(args.ray_address, **({} if args.ray_address else
                                                 {"num_cpus": 2 * args.groups, "include_dashboard": False}))
    return models, configs, trace, started_ray


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trace_arguments(ap, "opt-small", 120.0, "seconds of arrivals (~230 requests at 2/s: a p99 that is not one request)")
    ap.add_argument("--router", default="swap-aware", choices=["swap-aware", "round-robin"])
    ap.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    ap.add_argument("--out", default=None)
    workload.add_publish_arg(ap)
    args = ap.parse_args(argv)
    args.out = args.out or workload.results_path("cluster_run", "cluster_run.json")
    workload.check_outputs(ap, args.publish, args.out)

    from computron import EngineConfig
    from computron.cluster.serve import start_cluster
    models, configs, trace, started_ray = models_trace_and_ray(args)
    import ray
    print(f"[cluster_run] {args.groups} groups x {len(models)} {args.model}, {len(trace)} requests over "
          f"{args.duration:.0f}s, router {args.router}", file=sys.stderr, flush=True)
    t_launch = time.perf_counter()
    cluster = start_cluster(EngineConfig(max_loaded=args.max_loaded, max_batch_size=args.max_batch), configs,
                            args.groups, router=args.router)
    launch_s = time.perf_counter() - t_launch
    try:
        warm = [g.submit.remote(m, {"input_ids": [2, 5, 6, 7], "max_tokens": 2})
                for g in cluster.groups for m in models]
        ray.get(warm)
        skip = {i: len(recs) for i, recs in cluster.metrics().items()}
        loads0 = _loads(cluster)

        async def run():
            t0 = time.perf_counter()

            async def one(t, m, ids, n):
                await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))  # the trace's arrival time
                start = time.perf_counter()
                out = await cluster.submit(m, {"input_ids": ids, "max_tokens": n})
                assert len(out) == n, (m, n, len(out))
                return start - t0 - t, time.perf_counter() - start
            return await asyncio.gather(*(one(*a) for a in trace))

        results = asyncio.run(run())
        records = [r for i, recs in cluster.metrics().items() for r in recs[skip.get(i, 0):]]
        loads = {g: n - loads0.get(g, 0) for g, n in _loads(cluster).items()}
    finally:
        cluster.close()
        if started_ray:
            ray.shutdown()
    lat = [r[1] for r in results]
    mean_prompt = float(np.mean([len(a[2]) for a in trace]))
    doc = {"groups": args.groups, "models": models, "policy": args.router.replace("-", "_"),
           "trace": {"arrivals": [[round(t, 6), m, len(ids), n] for t, m, ids, n in trace], "warmup_s": 0},
           "mean_latency_s": float(np.mean(lat)), "p99_latency_s": workload.percentile(lat, 99),
           "p50_latency_s": workload.percentile(lat, 50),
           "costs": fit_costs(records, mean_prompt, args.max_loaded, len(models), args.max_batch,
                              f"cpu-{args.model}-cluster-run"),
           "latencies_s": [round(x, 6) for x in lat], "max_late_s": max(r[0] for r in results),
           "loads_per_group": loads, "launch_s": launch_s,
           "run": {k: getattr(args, k) for k in ("model", "max_loaded", "max_batch", "rate", "zipf", "cv", "duration",
                                                 "mean_tokens", "seed", "router")},
           "machine": workload.machine_info(), "load_average": os.getloadavg()}
    workload.write_json(args.out, doc)
    summary = {k: doc[k] for k in ("groups", "policy", "mean_latency_s", "p50_latency_s", "p99_latency_s",
                                   "loads_per_group", "max_late_s")}
    summary["requests"] = len(trace)
    summary["costs"] = {k: v for k, v in doc["costs"].items() if k != "source"}
    print(summary)
    return doc


def _loads(cluster) -> dict:
    import ray
    counters = ray.get([g.counters.remote() for g in cluster.groups])
    return {i: sum(v for (m, kind), v in c.get("swaps", {}).items() if kind == "load") for i, c in enumerate(counters)}


if __name__ == "__main__":
    main()
