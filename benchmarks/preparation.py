"""Request preparation against the master's steps: a burst of text requests while an LLM generates.

Prints exactly one JSON line on stdout; progress goes to stderr.

One causal LM (zoo shape ``--lm``) generates a long answer token by token while ``--burst`` requests of
long text (``--chars`` characters each) arrive at once for a text classifier (BERT-shaped, with its
tokenizer), both resident. Tokenizing those texts is CPU work on the master; the question is whether
it holds up the LLM's steps and the workers' heartbeats. Fields:
- ``step_gap_ms_p50/p99/max``: for the LLM, the time from one step's last reply leaving its worker to the
  next step being sent (the master's own per-step overhead, everything it did in between included),
  during the burst;
  ``quiet_step_gap_ms_p50``: the same before the burst.
- ``master_ms_per_step``: ``StepRecord.master_s`` (preparing a step and handling its replies), mean.
- ``heartbeat_late_ms_max``: the largest delay of a heartbeat's arrival past its interval, from the burst
  to the end of the LLM's answer.
- ``burst_s``: submit of the burst to its last answer.

    .venv/bin/python benchmarks/preparation.py                # 64 texts of 20,000 characters (~30 s)
    .venv/bin/python benchmarks/preparation.py --burst 16 --chars 500   # a smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

from workload import machine_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm", default="opt-tiny", help="zoo OPT shape of the generating model")
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--chars", type=int, default=20000, help="characters of each text")
    p.add_argument("--lm-tokens", type=int, default=3000, help="tokens the LLM generates meanwhile")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "computron-bench-preparation"))
    return p.parse_args(argv)


def checkpoints(workdir: str, lm: str):
    from computron import zoo, zoo_understanding as zu
    lm_path = zoo.save_random_causal_lm(lm, os.path.join(workdir, lm), seed=0, max_positions=4096)
    cls_path = zu.save_random_encoder("bert", os.path.join(workdir, "bert-sentiment"), "sequence", seed=1,
                                      labels=zu.LABEL_SETS["sentiment"])
    return lm_path, cls_path


def texts(n: int, chars: int):
    words = ("swap", "shard", "pipeline", "tensor", "model", "serve", "token", "batch", "host", "device")
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        text = " ".join(words[i] for i in rng.integers(0, len(words), size=chars // 5))
        out.append(text[:chars])
    return out


async def measure(engine, args):
    loop = asyncio.get_running_loop()
    beats = []  # (rank, arrival)
    engine.add_reply_observer(lambda r: type(r).__name__ == "Heartbeat" and beats.append((r.rank, time.perf_counter())))
    burst = [{"text": t} for t in texts(args.burst, args.chars)]  # made before: a client's own work
    await engine.submit("cls", {"text": "warm up"})
    baseline = asyncio.Event()  # set once the LLM has made QUIET_STEPS steps on its own
    steps = []
    engine.add_observer(lambda rec: rec.kind == "step" and (steps.append(rec) or len(steps) == QUIET_STEPS)
                        and loop.call_soon_threadsafe(baseline.set))
    lm = asyncio.ensure_future(engine.submit("lm", {"input_ids": [2, 10, 20], "max_tokens": args.lm_tokens}))
    await baseline.wait()
    quiet_until = time.perf_counter()
    t0 = time.perf_counter()
    await asyncio.gather(*[engine.submit("cls", r) for r in burst])
    t1 = time.perf_counter()
    await lm
    return beats, quiet_until, t0, t1, time.perf_counter()


QUIET_STEPS = 30


def gaps(steps, lo, hi):
    """From the last rank's end of one step (its reply leaving the worker) to the next step being sent."""
    out = []
    for a, b in zip(steps, steps[1:]):
        if lo <= b.start <= hi and a.rank_times:
            out.append(b.start - max(end for _, end in a.rank_times.values()))
    return out


def main(argv=None):
    args = parse_args(argv)
    from computron import EngineConfig, LaunchEngine, ModelConfig, TextClassificationBatchManager
    from computron.loading import load_causal_lm, load_encoder
    lm_path, cls_path = checkpoints(args.workdir, args.lm)
    configs = [ModelConfig("lm", load_causal_lm, {"path": lm_path}),
               ModelConfig("cls", load_encoder, {"path": cls_path},
                           batch_manager=TextClassificationBatchManager.for_checkpoint(cls_path))]
    config = EngineConfig(max_loaded=2)
    engine = LaunchEngine(config, configs)
    interval = min(config.heartbeat_timeout_s / 4, 1.0)

    async def go():
        async with engine:
            result = await measure(engine, args)
            return result, engine.metrics("step")
    (beats, quiet_until, t0, t1, t_end), steps = asyncio.run(go())
    steps = [s for s in steps if s.model_id == "lm"]
    during = gaps(steps, t0, t1)
    quiet = gaps(steps, 0.0, quiet_until)
    late = []
    for rank in {r for r, _ in beats}:
        times = [t for r, t in beats if r == rank]
        late += [(b - a) - interval for a, b in zip(times, times[1:]) if t0 <= b <= t_end]
    ms = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else None  # noqa: E731
    doc = {"benchmark": "preparation", "burst": args.burst, "chars": args.chars, "lm": args.lm,
           "burst_s": t1 - t0, "steps_during_burst": len(during),
           "step_gap_ms_p50": ms(during, 50), "step_gap_ms_p99": ms(during, 99), "step_gap_ms_max": ms(during, 100),
           "quiet_step_gap_ms_p50": ms(quiet, 50),
           "master_ms_per_step": 1e3 * float(np.mean([s.master_s for s in steps])),
           "heartbeat_late_ms_max": 1e3 * max(late) if late else None, "heartbeats_after_burst_start": len(late),
           "machine": machine_info()}
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
