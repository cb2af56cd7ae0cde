"""Generation benchmark: token-level (continuous batching, streaming) against request-level scheduling.

Prints exactly one JSON line on stdout; progress goes to stderr.

One seeded trace of Gamma arrivals (``experiments/workload.py``) over ``--models``
causal LMs, all resident (``max_loaded = models``), is replayed twice, one engine
after the other: ``token`` (``EngineConfig(step_mode=True)``, the default) and
``request`` (``step_mode=False``: each batch's whole generation is one command,
the paper's unit). Each request has a prompt of ``--prompt-min``..``--prompt-max``
random tokens and asks for a lognormal number of new tokens (mean
``--mean-tokens``, sigma 1, capped at ``--max-tokens-cap``). Every request is sent
with ``Engine.stream``, so the client sees each token when the engine releases it
(request level releases them all at the end). Before the trace, one request per
model loads every model (warm-up, not counted).

Fields (seconds unless named otherwise; ``*_ratio`` = token-level / request-level):
- ``ttft_mean/p50/p99``: submit to first token. ``tpot_p50/p99``: time per output
  token after the first, per request. ``e2e_p50/p99``: submit to last token.
- ``tokens_per_s``: output tokens of the whole trace / (last answer - first arrival).
- ``master_ms_per_step``: the master's own time per generation step (preparing
  the step, handling its reply; no forward), mean over the token-level run.
- ``ttft_p99_ratio``, ``tokens_per_s_ratio``, ``e2e_p99_ratio``. (Request level releases every token
  of an answer at once, so its time per output token is ~0 by construction: no ratio for it.)

    .venv/bin/python benchmarks/generation.py                  # opt-125m shapes, CPU, ~3 minutes
    .venv/bin/python benchmarks/generation.py --model opt-tiny --duration 4    # a smoke run
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402

from workload import llm_requests, machine_info, make_trace, replay_stream, summarize_llm  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m", help="zoo OPT shape (random weights)")
    p.add_argument("--models", type=int, default=3)
    p.add_argument("--rate", type=float, default=0.5, help="requests/s per model")
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of the Gamma arrivals")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-tokens", type=float, default=48.0)
    p.add_argument("--max-tokens-cap", type=int, default=256)
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=64)
    add_engine_args(p)
    return p.parse_args(argv)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options ``run_mode`` reads (shared with benchmarks/burst.py)."""
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-loaded", type=int, default=0, help="EngineConfig.max_loaded (0 = every model)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="EngineConfig.worker_threads (0 = automatic)")
    p.add_argument("--modes", default="token,request")
    p.add_argument("--policy", default="quantum", help="EngineConfig.policy of the token-level run")
    p.add_argument("--kv-cache", choices=("dynamic", "paged"), help="EngineConfig.kv_cache (default: its default)")
    p.add_argument("--cpu-helpers", choices=("on", "off"), help="EngineConfig.cpu_helpers (default: on)")


def parse_modes(text: str):
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("token", "request") for m in modes):
        raise SystemExit(f"--modes {text!r}: a comma-separated list of 'token' and 'request'")
    return modes


def make_requests(args):
    ids = [f"m{i}" for i in range(args.models)]
    trace = make_trace([args.rate] * args.models, args.cv, args.duration, args.seed, ids)
    return ids, llm_requests(trace, args.model, args.seed + 1, args.mean_tokens, args.max_tokens_cap,
                             (args.prompt_min, args.prompt_max))


async def replay(engine, ids, reqs, mode):
    for mid in ids:  # warm-up: load every model once
        await engine.submit(mid, {"input_ids": [2, 5], "max_tokens": 1})
    warm_up = len(engine.metrics())
    results = await replay_stream(engine.stream, reqs, mode, progress_every=10)
    return results, engine.metrics()[warm_up:]


def summarize(results, records):
    """``summarize_llm`` plus the engine's side: loads, steps, and the seconds spent in each kind of command."""
    out = summarize_llm(results)
    steps = [r for r in records if r.kind == "step"]
    out["loads"] = sum(1 for r in records if r.kind == "load")
    out["busy_s"] = {kind: sum(r.end - r.start for r in records if r.kind == kind)
                     for kind in ("load", "offload", "step", "batch")}
    if steps:
        out["steps"] = len(steps)
        out["master_ms_per_step"] = 1e3 * float(np.mean([s.master_s for s in steps]))
        out["mean_running_per_step"] = float(np.mean([s.running for s in steps]))
    return out


def run_mode(args, mode, ids, reqs):
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    configs = [ModelConfig(mid, zoo.random_causal_lm, {"name": args.model, "seed": i, "fast_init": True})
               for i, mid in enumerate(ids)]
    config = EngineConfig(max_loaded=args.max_loaded or len(ids), max_batch_size=args.max_batch_size,
                          step_mode=(mode == "token"), worker_threads=args.threads, policy=args.policy,
                          **({"kv_cache": args.kv_cache} if getattr(args, "kv_cache", None) else {}),
                          **({"cpu_helpers": args.cpu_helpers == "on"} if getattr(args, "cpu_helpers", None) else {}))
    print(f"[{mode}] starting {len(ids)} x {args.model}, TP={args.tp} PP={args.pp}, "
          f"max_loaded={config.max_loaded}", file=sys.stderr, flush=True)
    engine = LaunchEngine(config, configs, args.tp, args.pp)

    async def go():
        async with engine:
            return await replay(engine, ids, reqs, mode)
    summary = summarize(*asyncio.run(go()))
    print(f"[{mode}] {json.dumps(summary)}", file=sys.stderr, flush=True)
    return summary


def main(argv=None):
    args = parse_args(argv)
    modes = parse_modes(args.modes)
    ids, reqs = make_requests(args)
    print(f"{len(reqs)} requests over {args.duration}s, {sum(r[2]['max_tokens'] for r in reqs)} tokens asked",
          file=sys.stderr, flush=True)
    doc = {"benchmark": "generation", "model": args.model, "models": args.models, "rate_per_model": args.rate,
           "cv": args.cv, "duration_s": args.duration, "tp": args.tp, "pp": args.pp,
           "max_batch_size": args.max_batch_size, "machine": machine_info()}
    for mode in modes:
        doc[mode] = run_mode(args, mode, ids, reqs)
    if "token" in doc and "request" in doc:
        tok, req = doc["token"], doc["request"]
        for key, a, b in (("ttft_p99_ratio", "ttft_p99", "ttft_p99"), ("tokens_per_s_ratio", "tokens_per_s",
                                                                      "tokens_per_s"),
                          ("e2e_p99_ratio", "e2e_p99", "e2e_p99")):
            doc[key] = tok[a] / req[b] if tok.get(a) and req.get(b) else None
        doc["master_ms_per_step"] = tok.get("master_ms_per_step")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
