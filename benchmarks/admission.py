"""Admitting into a running batch: one padded forward against a decode forward and a prefill forward.

A step that admits a prompt of ``W`` tokens while ``R`` sequences run can run one forward, in which every
running row is padded to ``W`` columns (``R * (W - 1)`` positions computed for nothing), or two: a decode
of the running rows, then a prefill of the new ones. ``policies.prefill_apart`` chooses on the master from
the shapes and the shard's bytes. One engine (``--model``, random weights, TP=``--tp``) runs the same
workload three ways, alternately, ``--repeats`` times: ``one`` (never apart), ``apart`` (always, where
anything runs) and ``auto`` (the policy, the default). ``--running`` sequences generate while
``--requests`` requests of ``--prompt`` tokens and one new token arrive one after the other, so each is
admitted beside the running ones.

Prints one JSON line: per way, the median seconds of the admission steps' forwards (the slowest rank's own
time) and of each admitted request; ``admission_step_ratio`` (auto / one) and ``apart_step_ratio``
(apart / one); ``same_tokens``: every request got the same tokens every way (greedy).

    .venv/bin/python benchmarks/admission.py              # opt-125m, 4 running, prompts of 32 (about 2 minutes)
    .venv/bin/python benchmarks/admission.py --quick      # opt-tiny, the tests' path
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

from workload import machine_info  # noqa: E402

from computron.sched import policies  # noqa: E402

WAYS = {"one": float("inf"), "apart": 0.0, "auto": None}
"""Each way's ``policies.APART_MIN_WASTE`` for every device (None: the policy's own)."""
DEFAULT_WASTE = dict(policies.APART_MIN_WASTE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m", help="zoo OPT shape (random weights)")
    p.add_argument("--running", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32, help="tokens of each admitted request's prompt")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="opt-tiny, 3 requests, one repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.requests, args.repeats = "opt-tiny", 3, 1
    return args


async def one_way(engine, args, way: str) -> dict:
    policies.APART_MIN_WASTE.update(DEFAULT_WASTE if WAYS[way] is None else {k: WAYS[way] for k in DEFAULT_WASTE})
    before = len(engine.metrics("step"))
    long = {"input_ids": [2] + list(range(10, 10 + args.prompt)), "max_tokens": 2 * args.requests + 8}
    running = [asyncio.ensure_future(engine.submit("lm", dict(long))) for _ in range(args.running)]
    await engine.submit("lm", {"input_ids": [2, 5], "max_tokens": 1})  # admitted with them: they now run
    tokens, latencies = [], []
    for i in range(args.requests):
        t0 = time.perf_counter()
        out = await engine.submit("lm", {"input_ids": [2] + [(7 * i + j) % 400 + 10 for j in range(args.prompt - 1)],
                                         "max_tokens": 1})
        latencies.append(time.perf_counter() - t0)
        tokens.append(out.tolist())
    await asyncio.gather(*running)
    steps = [s for s in engine.metrics("step")[before:] if s.admitted and s.running > s.admitted]
    forward = [max(e - b for b, e in s.rank_times.values()) for s in steps]
    policies.APART_MIN_WASTE.update(DEFAULT_WASTE)
    return {"admission_steps": len(steps), "step_s": statistics.median(forward),
            "request_s": statistics.median(latencies), "tokens": tokens}


async def run(args) -> dict:
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    path = zoo.save_random_causal_lm(args.model,
                                     os.path.join(tempfile.gettempdir(), f"computron-admission-{args.model}"))
    config = EngineConfig(max_loaded=1, max_batch_size=args.running + 1)
    engine = await asyncio.to_thread(LaunchEngine, config, [ModelConfig("lm", zoo.load_causal_lm, {"path": path})],
                                     args.tp)
    async with engine:
        await engine.submit("lm", {"input_ids": [2, 5], "max_tokens": 2})  # loads it, warms the forward
        rows = {w: [] for w in WAYS}
        for rep in range(args.repeats):
            for way in (WAYS if rep % 2 == 0 else reversed(list(WAYS))):
                rows[way].append(await one_way(engine, args, way))
                print(f"  {way}: {({k: v for k, v in rows[way][-1].items() if k != 'tokens'})}", file=sys.stderr,
                      flush=True)
    med = {w: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "request_s", "admission_steps")}
           for w, rs in rows.items()}
    tokens = [r["tokens"] for rs in rows.values() for r in rs]
    return {"benchmark": "admission", "model": args.model, "tp": args.tp, "running": args.running,
            "prompt": args.prompt, "requests": args.requests, "repeats": args.repeats, "ways": med,
            "admission_step_ratio": med["auto"]["step_s"] / med["one"]["step_s"],
            "apart_step_ratio": med["apart"]["step_s"] / med["one"]["step_s"],
            "same_tokens": all(t == tokens[0] for t in tokens), "machine": machine_info()}


def main(argv=None) -> None:
    args = parse_args(argv)
    print(json.dumps(asyncio.run(run(args))), flush=True)

if __name__ == "__main__":
    main()
