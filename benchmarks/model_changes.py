"""Model changes while serving: does a model that is generating keep stepping while another is added?

Prints exactly one JSON line on stdout; progress goes to stderr.

One model (``--gen-model`` shape, random weights, saved as a checkpoint) streams one long generation at
TP=``--tp``; while it does, ``--adds`` times, a checkpoint of shape ``--add-model`` is added
(``Engine.add_model``: every rank builds its shard on a thread beside its command loop) and removed
again. From the generating model's step records: ``median_step_ms`` (steps before the first add),
``max_gap_during_add_ms`` (the longest time between two consecutive step ends while an add was under
way, over all adds), ``gap_ratio`` = the two's ratio (target <= 3), ``p99_gap_during_add_ms``; per add:
its seconds and the shard bytes built. Checkpoints are written once to ``--dir`` and reused.

    .venv/bin/python benchmarks/model_changes.py                  # opt-small generating, opt-125m added 3 times
    .venv/bin/python benchmarks/model_changes.py --quick          # tiny models, one add (the tests' path)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

from workload import machine_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gen-model", default="opt-small", help="zoo OPT shape of the generating model")
    p.add_argument("--add-model", default="opt-125m", help="zoo OPT shape of the model added while it generates")
    p.add_argument("--adds", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--baseline-tokens", type=int, default=40, help="tokens generated before the first add")
    p.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "computron-bench",
                                                 "model_changes"))
    p.add_argument("--quick", action="store_true", help="opt-tiny both, one add, TP=1")
    args = p.parse_args(argv)
    if args.quick:
        args.gen_model, args.add_model, args.adds, args.tp, args.baseline_tokens = \
            "opt-tiny", "opt-tiny", 1, 1, 10
    return args


def checkpoint(args, shape: str, seed: int) -> str:
    from computron import zoo
    path = os.path.join(args.dir, f"{shape}-seed{seed}")
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"writing {shape} checkpoint to {path}", file=sys.stderr, flush=True)
        zoo.save_random_causal_lm(shape, path, seed=seed)
    return path


async def run(args, gen_path: str, add_path: str) -> dict:
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    gen = ModelConfig("gen", zoo.load_causal_lm, {"path": gen_path})
    engine = LaunchEngine(EngineConfig(max_loaded=2), [gen], args.tp, 1)
    windows, adds = [], []
    async with engine:
        tokens = asyncio.Event()
        count = {"n": 0}
        total = args.baseline_tokens * (2 + 2 * args.adds) + 200

        async def generate():
            async for _ in engine.stream("gen", {"input_ids": [2, 5, 6, 7], "max_tokens": total}):
                count["n"] += 1
                if count["n"] >= args.baseline_tokens:
                    tokens.set()
        task = asyncio.ensure_future(generate())
        await tokens.wait()
        for k in range(args.adds):
            t0 = time.perf_counter()
            await engine.add_model(ModelConfig("added", zoo.load_causal_lm, {"path": add_path}))
            t1 = time.perf_counter()
            windows.append((t0, t1))
            sizes = {r: w.host_bytes for r, w in (await engine.stats_async()).items()}
            adds.append({"seconds": t1 - t0, "shard_bytes_per_rank": sizes})
            print(f"add {k + 1}/{args.adds}: {t1 - t0:.2f} s at {count['n']} tokens", file=sys.stderr, flush=True)
            await engine.remove_model("added")
            if task.done():
                raise RuntimeError("the generation ended before the adds did: raise --baseline-tokens")
        task.cancel()
        steps = [s for s in engine.metrics("step") if s.model_id == "gen" and s.error is None]
    ends = np.array(sorted(s.end for s in steps))
    gaps = np.diff(ends)
    before = gaps[ends[1:] < windows[0][0]]
    during = np.array([g for e, g in zip(ends[1:], gaps)
                       if any(a <= e and e - g <= b for a, b in windows)])  # gaps that overlap an add
    median = float(np.median(before))
    worst = float(during.max()) if len(during) else None
    return {"steps": len(steps), "median_step_ms": 1e3 * median,
            "max_gap_during_add_ms": 1e3 * worst if worst is not None else None,
            "p99_gap_during_add_ms": 1e3 * float(np.percentile(during, 99)) if len(during) else None,
            "steps_during_adds": int(len(during)),
            "gap_ratio": worst / median if worst is not None else None, "adds": adds}


def main(argv=None):
    args = parse_args(argv)
    gen_path = checkpoint(args, args.gen_model, 0)
    add_path = checkpoint(args, args.add_model, 1)
    result = asyncio.run(run(args, gen_path, add_path))
    doc = {"benchmark": "model_changes", "gen_model": args.gen_model, "add_model": args.add_model,
           "tp": args.tp, **result, "targets": {"gap_ratio": "<= 3"}, "machine": machine_info()}
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
