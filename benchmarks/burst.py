"""Burst benchmark: many short requests over several models, all submitted at once, through one device slot.

Prints exactly one JSON line on stdout; progress goes to stderr.

``--requests`` requests (round robin over ``--models`` causal LMs of zoo shape ``--model``, each asking
for ``--min-tokens``..``--max-tokens`` new tokens after a short random prompt) arrive at the same instant
at an engine with ``max_loaded=1`` (``--max-loaded``), so serving them means swapping. The same burst is
replayed by token-level generation (``step_mode=True``, the default) and by request-level generation
(``step_mode=False``), one engine after the other in one run. Fields per mode: ``requests_per_s``
(requests / time to the last answer), ``e2e_p50``/``e2e_p99``, ``ttft_p50``, ``swaps`` (loads), ``steps``;
``requests_per_s_ratio`` and ``e2e_p50_ratio`` are token-level / request-level.

    .venv/bin/python benchmarks/burst.py                         # 300 requests, 3 x opt-tiny, TP=2 (~1 minute)
    .venv/bin/python benchmarks/burst.py --requests 60 --tp 1    # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

from generation import add_engine_args, parse_modes, run_mode  # noqa: E402
from workload import machine_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-tiny", help="zoo OPT shape (random weights)")
    p.add_argument("--models", type=int, default=3)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--min-tokens", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(tp=2, max_loaded=1)
    return p.parse_args(argv)


def burst(args):
    """``(ids, [(arrival 0, model_id, request), ...])``: the whole burst, seeded."""
    from computron import zoo
    rng = np.random.default_rng(args.seed)
    vocab = zoo.hf_config(args.model).vocab_size
    ids = [f"m{i}" for i in range(args.models)]
    reqs = []
    for k in range(args.requests):
        prompt = [2] + [int(x) for x in rng.integers(4, vocab, size=args.prompt_len - 1)]
        n_new = int(rng.integers(args.min_tokens, args.max_tokens + 1))
        reqs.append((0.0, ids[k % len(ids)], {"input_ids": prompt, "max_tokens": n_new}))
    return ids, reqs


def summarize_burst(summary: dict) -> dict:
    span = summary.get("span_s")
    return {"requests": summary["requests"], "errors": summary["errors"],
            "requests_per_s": summary["requests"] / span if span else None,
            "e2e_p50": summary["e2e_p50"], "e2e_p99": summary["e2e_p99"], "ttft_p50": summary["ttft_p50"],
            "swaps": summary["loads"], "steps": summary.get("steps"), "busy_s": summary["busy_s"],
            "master_ms_per_step": summary.get("master_ms_per_step")}


def main(argv=None):
    args = parse_args(argv)
    modes = parse_modes(args.modes)
    ids, reqs = burst(args)
    print(f"{len(reqs)} requests at once over {len(ids)} x {args.model}, TP={args.tp} PP={args.pp}, "
          f"max_loaded={args.max_loaded}", file=sys.stderr, flush=True)
    doc = {"benchmark": "burst", "model": args.model, "models": args.models, "requests": args.requests,
           "tokens": [args.min_tokens, args.max_tokens], "tp": args.tp, "pp": args.pp,
           "max_loaded": args.max_loaded, "max_batch_size": args.max_batch_size, "machine": machine_info()}
    for mode in modes:
        doc[mode] = summarize_burst(run_mode(args, mode, ids, reqs))
    if "token" in doc and "request" in doc:
        tok, req = doc["token"], doc["request"]
        doc["requests_per_s_ratio"] = (tok["requests_per_s"] / req["requests_per_s"]
                                       if tok["requests_per_s"] and req["requests_per_s"] else None)
        doc["e2e_p50_ratio"] = tok["e2e_p50"] / req["e2e_p50"] if tok["e2e_p50"] and req["e2e_p50"] else None
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
