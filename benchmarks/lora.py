"""LoRA benchmark: many fine-tunes as adapters on one resident base, against the same fine-tunes merged.

Prints exactly one JSON line on stdout; progress goes to stderr.

A random-weight ``--model`` checkpoint (OPT shape) and ``--adapters`` PEFT LoRA adapters of rank
``--rank`` on every attention projection (q, k, v, out) are written to ``--dir`` once and reused, with
the same adapters merged into full checkpoints (``merge_and_unload``). Measured in one run:

- ``mixed_batch_tokens_per_s_ratio``: 8 sequences on 8 different adapters in one batch vs 8 on the bare
  base (same prompts and lengths), tokens per second of the whole batch, median of ``--repeats`` pairs run
  alternately (target >= 0.6);
- ``adapter_load_vs_base_load``: seconds to bring one adapter into a device slot (the workers' own
  measurement of the host-to-device copy, slowest rank, mean over the adapters' first use) / seconds of
  the base's load from host memory (its ``SwapRecord``, slowest rank) (target <= 0.05); also
  ``adapter_add_s`` (``Engine.add_model`` of one more adapter: disk to every rank's host memory, and
  the round trip);
- ``rate_ratio_vs_merged``: the **sustainable rate** of one engine holding the base and its adapters / that
  of one engine holding the merged checkpoints (``max_loaded=1`` both: one model resident, as when a device
  holds one base) (target >= 3). Each engine replays the same seeded Poisson traces (``--duration`` s each,
  longer where needed for ``--min-requests``; requests spread evenly over the fine-tunes) at rates of the
  ``--rates`` grid (steps of 1.41x), from ``--start-rate`` up while sustained, else down until sustained,
  then ``--refine`` geometric bisections between the last rate sustained and the first one not (two: steps
  of 1.09x); its sustainable rate is the highest whose p90 latency stays within ``--slo-factor`` times one
  lone request's latency on the adapter engine (the same bound for both) while the next rate up does not.
  Per rate: mean and p90 latency, loads so far; ``merged_engine.load_s_median``: what one swap of a merged
  checkpoint took. ``--threads`` sets both engines' ``EngineConfig.worker_threads``.
- ``capacity_ratio``: what the two engines' own step times allow for that ratio, whatever the scheduling:
  a merged checkpoint serving one request per swap, unbatched, against the adapters with every decode step
  a full batch of one sequence per adapter. Its parts are in each engine's row: ``prefill_step_s`` (a lone
  request's admission step), ``decode_step_1_s`` (its decode steps), ``decode_step_batch_s`` (a decode step
  of the mixed batch of ``batch`` sequences). On a GPU a decode step of 8 costs about what one of 1 does
  and a swap many steps. On this 2-core CPU with the default threads (one worker thread, a core left to
  the master) a step of 8 costs about 2.5x one and the swap of an opt-125m about two steps, which puts this
  ratio at 2-3; with both cores (``--threads 2``, where Linears of a few rows run weight-first:
  ``computron/kernels/cpu/linear.py``) a step of 8 costs 1.7x one and a swap 2.4 steps: about 4.

    .venv/bin/python benchmarks/lora.py                 # opt-125m, 8 adapters of rank 16 (about ten minutes)
    .venv/bin/python benchmarks/lora.py --threads 2     # the same, each engine's one worker on both cores
    .venv/bin/python benchmarks/lora.py --quick         # opt-tiny, short trace (the tests' path)
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

ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-125m", help="zoo OPT shape of the base (random weights)")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per sequence in the batch comparison")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rates", default="0.0625,0.088,0.125,0.177,0.25,0.35,0.5,0.71,1,1.41,2,2.83,4,5.66,8",
                   help="the rates that may be tried (requests/s over all fine-tunes, steps of about 1.41x)")
    p.add_argument("--start-rate", type=float, default=0.5, help="the first rate tried, for both engines")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each rate's trace, at least")
    p.add_argument("--min-requests", type=int, default=24,
                   help="each rate's trace lasts long enough for this many requests (its p90 is no lone outlier)")
    p.add_argument("--refine", type=int, default=2,
                   help="bisections between the grid's last sustained rate and its first unsustained one")
    p.add_argument("--slo-factor", type=float, default=4.0)
    p.add_argument("--trace-tokens", type=int, default=8, help="new tokens per request of the trace")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--threads", type=int, default=0,
                   help="EngineConfig.worker_threads of both engines (0 = automatic: one core left to the master)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "computron-bench", "lora"))
    p.add_argument("--quick", action="store_true",
                   help="opt-tiny, 4 adapters of rank 8, traces of 1-3 s, one bisection")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.adapters, args.rank, args.tokens, args.repeats = "opt-tiny", 4, 8, 8, 1
        args.rates, args.duration, args.trace_tokens, args.start_rate, args.min_requests = "1,2,4,8", 1.0, 4, 2, 3
        args.refine = min(args.refine, 1)
    return args


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def write_checkpoints(args) -> tuple:
    """(base dir, [adapter dirs], [merged dirs]), written once under ``--dir``."""
    from peft import PeftModel

    from computron import zoo
    from computron.testing.zoo_lora import save_random_lora
    root = os.path.join(args.dir, f"{args.model}-r{args.rank}")
    base = os.path.join(root, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        log(f"writing {args.model} to {base}")
        zoo.save_random_causal_lm(args.model, base, seed=args.seed)
    adapters, merged = [], []
    for i in range(args.adapters + 1):  # the last one is added while serving
        a = os.path.join(root, f"adapter{i}")
        if not os.path.exists(os.path.join(a, "adapter_config.json")):
            save_random_lora(base, a, seed=100 + i, r=args.rank, alpha=2 * args.rank, targets=ATTENTION)
        adapters.append(a)
        if i == args.adapters:
            continue
        m = os.path.join(root, f"merged{i}")
        if not os.path.exists(os.path.join(m, "config.json")):
            log(f"merging adapter {i} into {m}")
            model = PeftModel.from_pretrained(zoo.load_causal_lm(base), a).merge_and_unload()
            model.save_pretrained(m)
        merged.append(m)
    return base, adapters, merged


def trace(args, rate, ids):
    """Seeded Poisson arrivals at ``rate``, over ``--duration`` s or long enough for ``--min-requests``, the
    fine-tunes in turn."""
    rng = np.random.default_rng(args.seed)
    span = max(args.duration, args.min_requests / rate)
    t, out = 0.0, []
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= span:
            return out
        out.append((t, ids[len(out) % len(ids)]))


async def sustainable(engine, args, ids, prompt, bound_s) -> tuple:
    """(the highest rate whose p90 latency stays within ``bound_s`` while the next one up does not, a row
    per rate tried): along the ``--rates`` grid from ``--start-rate`` up while sustained, else down until
    sustained (0.0 when even the lowest is not); then ``--refine`` geometric bisections between the highest
    rate sustained and the lowest one not, so that the rate is known to a finer step than the grid's."""
    grid = sorted(float(x) for x in args.rates.split(","))
    i = min(range(len(grid)), key=lambda k: abs(grid[k] - args.start_rate))
    rows, ok = [], {}

    async def attempt(rate):
        lat = await replay(engine, trace(args, rate, ids), prompt, args.trace_tokens)
        p90 = float(np.percentile(lat, 90)) if len(lat) else 0.0
        ok[rate] = p90 <= bound_s
        rows.append({"rate": rate, "requests": len(lat), "mean_s": float(lat.mean()) if len(lat) else 0.0,
                     "p90_s": p90, "sustained": ok[rate], "loads_so_far": len(engine.metrics("load"))})
        log(f"  rate {rate:.3g}/s: {rows[-1]}")

    while 0 <= i < len(grid) and grid[i] not in ok:
        await attempt(grid[i])
        i += 1 if ok[grid[i]] else -1
    for _ in range(args.refine):
        lo = max((r for r, good in ok.items() if good), default=None)
        hi = min((r for r, good in ok.items() if not good and (lo is None or r > lo)), default=None)
        if lo is None or hi is None:
            break
        await attempt(round(float(np.sqrt(lo * hi)), 4))
    return max((r for r, good in ok.items() if good), default=0.0), rows


async def replay(engine, arrivals, prompt, n):
    t0 = time.perf_counter()

    async def one(at, model_id):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))  # the trace's arrival time
        start = time.perf_counter()
        await engine.submit(model_id, {"input_ids": prompt, "max_tokens": n})
        return time.perf_counter() - start
    lat = await asyncio.gather(*[one(at, m) for at, m in arrivals])
    return np.array(lat)


async def batch_tokens_per_s(engine, ids, prompt, n) -> float:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[engine.submit(m, {"input_ids": prompt, "max_tokens": n}) for m in ids])
    return sum(len(o) for o in outs) / (time.perf_counter() - t0)


def steps_of(engine, since: int) -> list:
    """The step records made since the engine had ``since`` of them."""
    return engine.metrics("step")[since:]


def median_step_s(steps, running: int, admitted: int):
    """Median seconds of the steps that gave ``running`` sequences a token, ``admitted`` of them new."""
    xs = [r.end - r.start for r in steps if r.running == running and r.admitted == admitted and not r.error]
    return float(np.median(xs)) if xs else None


async def lone_request_steps(engine, model_id, prompt, n) -> tuple:
    """(seconds, the prefill step's median seconds, a decode step's) of one request alone on the engine."""
    since, t0 = len(engine.metrics("step")), time.perf_counter()
    await engine.submit(model_id, {"input_ids": prompt, "max_tokens": n})
    seconds, steps = time.perf_counter() - t0, steps_of(engine, since)
    return seconds, median_step_s(steps, 1, 1), median_step_s(steps, 1, 0)


def capacity_ratio(a: dict, m: dict, n: int):
    """Requests per second the adapters could serve at best over what the merged checkpoints could, from
    each engine's own step times (None where one is missing): the merged engine serving one request per
    swap, unbatched (a prefill, n - 1 decode steps of one sequence, a swap), the adapter engine with every
    decode step a full batch, one sequence per adapter (a prefill, n - 1 shares of a step of that batch)."""
    parts = (m["prefill_step_s"], m["decode_step_1_s"], m["load_s_median"], a["prefill_step_s"],
             a["decode_step_batch_s"])
    if any(x is None for x in parts):
        return None
    p_m, c1, swap, p_a, c_batch = parts
    return (p_m + (n - 1) * c1 + swap) / (p_a + (n - 1) * c_batch / a["batch"])


def lora_fills(stats) -> tuple:
    """(seconds of the slowest rank, adapter fills) of device-slot fills so far."""
    return max(s.lora_fill_s for s in stats.values()), min(s.lora_fills for s in stats.values())


async def adapters_run(args, base, adapters, prompt) -> dict:
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    ids = [f"ft{i}" for i in range(args.adapters)]
    configs = [ModelConfig("base", zoo.load_causal_lm, {"path": base})]
    configs += [ModelConfig(m, base="base", adapter=a) for m, a in zip(ids, adapters)]
    log(f"[adapters] base {args.model} + {len(ids)} adapters of rank {args.rank}, TP={args.tp}")
    engine = await asyncio.to_thread(LaunchEngine, EngineConfig(max_loaded=1, max_loras=len(ids),
                                                                max_lora_rank=max(64, args.rank),
                                                                worker_threads=args.threads),
                                     configs, args.tp)
    out = {}
    async with engine:
        await engine.submit("base", {"input_ids": prompt, "max_tokens": 2})  # loads the base
        base_load = max(r.end - r.start for r in engine.metrics("load") if r.model_id == "base")
        fill0, n0 = lora_fills(await engine.stats_async())
        mixed, bare, mixed_steps = [], [], []
        for k in range(args.repeats):
            since = len(engine.metrics("step"))
            mixed.append(await batch_tokens_per_s(engine, ids, prompt, args.tokens))
            mixed_steps += steps_of(engine, since)
            if k == 0:
                fill1, n1 = lora_fills(await engine.stats_async())
            bare.append(await batch_tokens_per_s(engine, ["base"] * len(ids), prompt, args.tokens))
        fill_s = (fill1 - fill0) / max(1, n1 - n0)
        t0 = time.perf_counter()
        await engine.add_model(ModelConfig("late", base="base", adapter=adapters[-1]))
        out["adapter_add_s"] = time.perf_counter() - t0
        lone_s, prefill_s, decode_s = await lone_request_steps(engine, ids[0], prompt, args.trace_tokens)
        bound = args.slo_factor * lone_s
        loads0 = len(engine.metrics("load"))
        rate, rows = await sustainable(engine, args, ids, prompt, bound)
        out.update({"mixed_tokens_per_s": float(np.median(mixed)), "bare_tokens_per_s": float(np.median(bare)),
                    "adapter_fill_s": fill_s, "adapter_fills": n1 - n0, "base_load_s": base_load,
                    "latency_bound_s": bound, "sustainable_rate": rate, "rates": rows,
                    "prefill_step_s": prefill_s, "decode_step_1_s": decode_s,
                    "batch": len(ids), "decode_step_batch_s": median_step_s(mixed_steps, len(ids), 0),
                    "trace_loads": len(engine.metrics("load")) - loads0})
    return out


async def merged_run(args, merged, prompt, bound_s: float) -> dict:
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    configs = [ModelConfig(f"ft{i}", zoo.load_causal_lm, {"path": m}) for i, m in enumerate(merged)]
    log(f"[merged] {len(configs)} merged {args.model} checkpoints, TP={args.tp}, max_loaded=1")
    engine = await asyncio.to_thread(LaunchEngine, EngineConfig(max_loaded=1, worker_threads=args.threads),
                                     configs, args.tp)
    async with engine:
        await engine.submit(configs[0].model_id, {"input_ids": prompt, "max_tokens": 1})  # its load
        _, prefill_s, decode_s = await lone_request_steps(engine, configs[0].model_id, prompt, args.trace_tokens)
        rate, rows = await sustainable(engine, args, [mc.model_id for mc in configs], prompt, bound_s)
        loads = [r.end - r.start for r in engine.metrics("load")]
        return {"sustainable_rate": rate, "rates": rows, "trace_loads": len(loads),
                "load_s_median": float(np.median(loads)) if loads else None,
                "prefill_step_s": prefill_s, "decode_step_1_s": decode_s}


def main(argv=None):
    args = parse_args(argv)
    base, adapters, merged = write_checkpoints(args)
    prompt = [2] + list(range(10, 25))
    a = asyncio.run(adapters_run(args, base, adapters, prompt))
    log(f"[adapters] {json.dumps(a)}")
    m = asyncio.run(merged_run(args, merged, prompt, a["latency_bound_s"]))
    log(f"[merged] {json.dumps(m)}")
    doc = {"benchmark": "lora", "model": args.model, "adapters": args.adapters, "rank": args.rank,
           "targets_modules": list(ATTENTION), "tp": args.tp, "worker_threads": args.threads,
           "rates_grid": args.rates, "refine": args.refine, "start_rate": args.start_rate,
           "min_requests": args.min_requests, "duration_s": args.duration, "trace_tokens": args.trace_tokens,
           "mixed_batch_tokens_per_s_ratio": a["mixed_tokens_per_s"] / a["bare_tokens_per_s"],
           "adapter_load_vs_base_load": a["adapter_fill_s"] / a["base_load_s"],
           # the merged engine sustaining none of the rates: the ratio is above ours / the lowest rate tried
           "rate_ratio_vs_merged": a["sustainable_rate"] / (m["sustainable_rate"]
                                                             or min(float(x) for x in args.rates.split(","))),
           "rate_ratio_vs_merged_is_lower_bound": not m["sustainable_rate"],
           "rate_ratio_measure": "sustainable rate (adapters / merged): the highest rate tried whose p90 latency "
                                 "stays within slo_factor x a lone request's latency, same traces",
           "slo_factor": args.slo_factor,
           "capacity_ratio": capacity_ratio(a, m, args.trace_tokens),
           "adapters_engine": a, "merged_engine": m,
           "targets": {"mixed_batch_tokens_per_s_ratio": ">= 0.6", "adapter_load_vs_base_load": "<= 0.05",
                       "rate_ratio_vs_merged": ">= 3"},
           "machine": machine_info()}
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
