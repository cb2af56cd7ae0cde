"""Residency benchmark: which models stay on the devices, ``EngineConfig(eviction="lru")`` against ``"cost"``.

Prints exactly one JSON line on stdout; progress goes to stderr.

Causal LMs of mixed sizes (``--models``: zoo OPT shapes with random weights) share a device byte budget
(``EngineConfig.device_budget``, ``max_loaded=None``) that holds about ``--budget-fraction`` of their bytes.
The default models are opt-small shapes that differ in vocabulary only (131072, 32768 and 512 ids: 178, 67
and 31 MB per rank with the KV reserve, 5.8:1), so that a load costs much more than a forward, as on GPUs (a
13 GB model loads in 0.25 s there, a decode step takes ~20 ms); with opt-125m shapes this CPU spends as long
on forwards as on loads, and two engines side by side saturate it. There are 24 of them, 6 large, 6 medium
and 12 small (a fleet with more small models than large ones): with several models of each size class an
eviction policy has choices to make, where with 2 large models of which only one fits (the former 8-model
default) they evict each other whatever the policy. ``residency_sim.py`` replays this trace through the
real scheduler on a simulated clock (seconds a run; ``--seeds 0-19`` for the spread over seeds): on it, the
24 models give ``cost`` 0.87 of LRU's bytes and 0.95 of its p99 TTFT (medians over 20 seeds), the 8 models
0.93 and 0.99; with ``--bounds``, even an offline policy that knows every future arrival (Belady) meets both
targets on only 10 of 20 seeds (medians 0.53 and 0.80), so the targets measure the policy against a bound
that clairvoyance reaches half the time.
Requests arrive as Poisson processes whose rates follow a Zipf law (exponent ``--zipf``, total ``--rate``
requests/s); which model gets which popularity rank is a seeded permutation, so popularity and size are
unrelated. Prompts of ``--prompt-min``..``--prompt-max`` random tokens ask for a lognormal number of new
tokens (mean ``--mean-tokens``). Every request is streamed (``Engine.stream``): TTFT is submit to first token.

The same trace is replayed through one engine per eviction policy, side by side: each engine lives in a
child process of this script (one engine per process), starts, answers one request per model (warm-up, not
counted), and the replays start together once all are ready, so that every policy sees the same background
load on a shared machine. ``--sequential`` runs them one after the other instead.

Fields: per policy (``lru``, ``cost``) ``loads`` and ``bytes_loaded`` (loads of the replay, from
``Engine.metrics("load")``, bytes over all ranks), ``loads_per_model``, ``load_s`` (sum of the slowest rank's
load times), ``preemptions``, ``ttft_p50/p99/mean``, ``e2e_p50/p99``, ``requests``, ``errors``, ``span_s``;
``bytes_moved_ratio`` and ``ttft_p99_ratio`` (cost / lru); ``targets`` (bytes_moved_ratio <= 0.7,
ttft_p99_ratio <= 0.8, each true/false); ``sizes`` (bytes per rank with the KV reserve, as the scheduler
counts them), ``budget``, ``rates`` (requests/s per model) and the trace parameters. ``--dump PATH`` also
writes every request's, every swap's and every step's record (``residency_sim.py``'s costs come from them).

    .venv/bin/python benchmarks/residency.py            # 24 models, 120 s of arrivals at 3/s, ~5 min
    .venv/bin/python benchmarks/residency.py --quick    # 6 smaller models, 6 s of arrivals, about a minute
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

import numpy as np  # noqa: E402

from workload import llm_requests, machine_info, make_trace, replay_stream, summarize_llm  # noqa: E402

POLICIES = ("lru", "cost")
TAG = "@residency"  # marks the lines a child process writes for its parent
TARGETS = {"bytes_moved_ratio": 0.7, "ttft_p99_ratio": 0.8}
FULL = {"models": "6xopt-small:131072,6xopt-small:32768,12xopt-small", "rate": 3.0, "duration": 120.0}
QUICK = {"models": "2xopt-small:8192,4xopt-tiny:8192", "rate": 8.0, "duration": 6.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"small models, short trace (defaults {QUICK})")
    p.add_argument("--models", help="comma-separated zoo OPT shapes, each [Nx]name[:vocab] "
                                    f"(default {FULL['models']!r})")
    p.add_argument("--rate", type=float, help=f"total requests/s over all models (default {FULL['rate']})")
    p.add_argument("--duration", type=float, help=f"seconds of arrivals (default {FULL['duration']})")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the models' popularity")
    p.add_argument("--cv", type=float, default=1.0, help="CV of each model's Gamma arrivals (1: Poisson)")
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="device budget as a fraction of all models' bytes (with their KV reserve)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-tokens", type=float, default=4.0, help="mean new tokens per request (lognormal)")
    p.add_argument("--max-tokens-cap", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="EngineConfig.worker_threads (0 = automatic)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--policy", default="quantum", help="EngineConfig.policy (when a running model is preempted)")
    p.add_argument("--policies", default=",".join(POLICIES), help="eviction policies to run, in this order")
    p.add_argument("--sequential", action="store_true",
                   help="one engine after the other instead of side by side (each alone on the machine)")
    p.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)  # one policy's engine (see run)
    p.add_argument("--dump", help="also write every request's, swap's and step's record to this JSON file")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not args.policies or any(x not in POLICIES for x in args.policies):
        p.error(f"--policies: a comma-separated subset of {POLICIES}")
    if not 0 < args.budget_fraction <= 1:
        p.error("--budget-fraction must be in (0, 1]")
    return args


def parse_models(text: str):
    """``[(model_id, shape, vocab or None), ...]`` from ``[Nx]name[:vocab],...``."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        match = re.fullmatch(r"(?:(\d+)x)?([\w.-]+?)(?::(\d+))?", item)
        if not match:
            raise SystemExit(f"--models: {item!r} is not [Nx]name[:vocab]")
        count, name, vocab = match.groups()
        for _ in range(int(count or 1)):
            out.append((f"m{len(out)}", name, int(vocab) if vocab else None))
    if len(out) < 2:
        raise SystemExit(f"--models {text!r}: at least two models are needed")
    return out


def label(name: str, vocab) -> str:
    return f"{name}:{vocab}" if vocab else name


def shard_bytes(name: str, vocab) -> int:
    """Bytes of a model's parameters and buffers (fp32, tp=1), counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from computron import zoo
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(zoo.hf_config(name, vocab_size=vocab))
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def zipf_rates(n: int, total: float, exponent: float, seed: int) -> np.ndarray:
    """Per model, ``total`` split by a Zipf law over popularity ranks given by a seeded permutation."""
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    ranks = np.random.default_rng(seed).permutation(n)  # model i has popularity rank ranks[i]
    return total * weights[ranks] / weights.sum()


def launch(args, policy, models, budget):
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    configs = [ModelConfig(mid, zoo.random_causal_lm,
                           {"name": name, "seed": i, "fast_init": True, **({"vocab_size": v} if v else {})})
               for i, (mid, name, v) in enumerate(models)]
    config = EngineConfig(max_loaded=None, device_budget=budget, eviction=policy, policy=args.policy,
                          max_batch_size=args.max_batch_size, worker_threads=args.threads)
    print(f"[{policy}] starting {len(models)} models, budget {budget / 1e6:.1f} MB per rank", file=sys.stderr,
          flush=True)
    return LaunchEngine(config, configs, args.tp)


async def serve(engine, ids, reqs, label, wait_for_go):
    """Warm up (every model once: its first load and first forward, not counted), say ``ready`` on stdout,
    wait for ``go`` on stdin (``wait_for_go``), replay the trace."""
    for mid in ids:
        await engine.submit(mid, {"input_ids": [2, 5], "max_tokens": 1})
    warm_up = len(engine.metrics())
    if wait_for_go:
        print(f"{TAG} ready", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if line.strip() != "go":
            raise SystemExit(f"[{label}] expected 'go' on stdin, got {line!r}")
    results = await replay_stream(engine.stream, reqs, label, progress_every=50)
    sizes = {m: int(max(w.host_bytes.get(m, 0) for w in engine.workers.values()) * (1 + engine.config.kv_reserve))
             for m in ids}
    return results, engine.metrics()[warm_up:], sizes


def child(args, models, budget, reqs):
    """One policy's engine (``--child POLICY``, started by ``run``): one JSON line of its results on stdout."""
    engine = launch(args, args.child, models, budget)

    async def go():
        async with engine:
            return await serve(engine, [m[0] for m in models], reqs, args.child, wait_for_go=not args.sequential)
    results, records, sizes = asyncio.run(go())
    out, dump = summarize(args.child, models, results, records)
    print(f"{TAG} " + json.dumps({"summary": out, "sizes": sizes, "dump": dump}), flush=True)


def _tagged(proc) -> str:
    """The next line a child meant for us (``TAG`` first); anything else it printed goes on to stderr."""
    for line in proc.stdout:
        if line.startswith(TAG + " "):
            return line[len(TAG) + 1:].strip()
        sys.stderr.write(line)
    return ""


def run(args, argv):
    """``{policy: {"summary", "sizes", "dump"}}``: one process per policy (torch.distributed allows one engine per
    process). Side by side, the children start and warm up their engines, and replay the trace together
    once all are ready, so that every policy sees the same background load; with ``--sequential``, one after
    the other."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv]
    groups = [[p] for p in args.policies] if args.sequential else [args.policies]
    out = {}
    for group in groups:
        procs = {}
        try:
            for policy in group:
                procs[policy] = subprocess.Popen(cmd + ["--child", policy], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, text=True)
            if not args.sequential:
                for policy, proc in procs.items():
                    if _tagged(proc) != "ready":
                        raise SystemExit(f"[{policy}] engine failed before the replay (exit {proc.wait()})")
                for proc in procs.values():
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
            for policy, proc in procs.items():
                line = _tagged(proc)
                if proc.wait() != 0 or not line:
                    raise SystemExit(f"[{policy}] failed (exit {proc.returncode})")
                out[policy] = json.loads(line)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return out


def summarize(policy, models, results, records):
    loads = [r for r in records if r.kind == "load" and not r.error]
    offloads = [r for r in records if r.kind == "offload" and not r.error]
    summary = summarize_llm(results)
    out = {"requests": summary["requests"], "errors": summary["errors"], "loads": len(loads),
           "bytes_loaded": sum(r.nbytes for r in loads),
           "loads_per_model": {m: sum(1 for r in loads if r.model_id == m) for m, _, _ in models},
           "preemptions": sum(1 for r in offloads if r.cause.startswith("preempted")),
           "load_s": sum(max(r.rank_durations.values(), default=r.duration) for r in loads),
           **{k: summary[k] for k in ("ttft_p50", "ttft_p99", "ttft_mean", "e2e_p50", "e2e_p99", "span_s")}}
    print(f"[{policy}] {json.dumps(out)}", file=sys.stderr, flush=True)
    dump = {"results": results, "swaps": [{"kind": r.kind, "model": r.model_id, "start": r.start, "end": r.end,
                                           "rank_s": max(r.rank_durations.values(), default=None),
                                           "bytes": r.nbytes, "cause": r.cause}
                                          for r in records if r.kind in ("load", "offload")],
            "steps": [{"model": r.model_id, "start": r.start, "end": r.end, "running": r.running,
                       "admitted": r.admitted} for r in records if r.kind == "step"]}
    return out, dump


def ratio(a, b):
    return a / b if a is not None and b else None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    models = parse_models(args.models)
    ids = [m[0] for m in models]
    kv_reserve = 0.1  # EngineConfig's default: the scheduler counts shard bytes * (1 + kv_reserve)
    est = {mid: int(shard_bytes(name, v) * (1 + kv_reserve)) for mid, name, v in models}
    budget = max(int(args.budget_fraction * sum(est.values())), max(est.values()))
    rates = zipf_rates(len(ids), args.rate, args.zipf, args.seed)
    trace = make_trace(list(rates), args.cv, args.duration, args.seed, ids)
    reqs = llm_requests(trace, "opt-tiny", args.seed + 1, args.mean_tokens, args.max_tokens_cap,
                        (args.prompt_min, args.prompt_max))  # opt-tiny's 512 ids fit every vocabulary
    if args.child:
        return child(args, models, budget, reqs)
    print(f"{len(reqs)} requests over {args.duration:g} s, {len(ids)} models "
          f"({', '.join(f'{m}={label(n, v)}' for m, n, v in models)}), "
          f"rates {np.round(rates, 2).tolist()}", file=sys.stderr, flush=True)
    doc = {"benchmark": "residency", "quick": args.quick, "models": {m: label(n, v) for m, n, v in models},
           "rates": {m: round(float(r), 4) for m, r in zip(ids, rates)}, "zipf": args.zipf, "cv": args.cv,
           "total_rate": args.rate, "duration_s": args.duration, "requests": len(reqs), "seed": args.seed,
           "mean_tokens": args.mean_tokens, "budget": budget, "budget_fraction": args.budget_fraction,
           "tp": args.tp, "policy": args.policy, "side_by_side": not args.sequential, "machine": machine_info()}
    dumps = {}
    for policy, res in run(args, argv).items():
        doc[policy], doc["sizes"], dumps[policy] = res["summary"], res["sizes"], res["dump"]
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(dumps, f)
    if "lru" in doc and "cost" in doc:
        lru, cost = doc["lru"], doc["cost"]
        doc["bytes_moved_ratio"] = ratio(cost["bytes_loaded"], lru["bytes_loaded"])
        doc["ttft_p99_ratio"] = ratio(cost["ttft_p99"], lru["ttft_p99"])
        doc["targets"] = {k: doc[k] is not None and doc[k] <= v for k, v in TARGETS.items()}
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
