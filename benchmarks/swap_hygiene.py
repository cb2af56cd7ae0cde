"""Swap hygiene: does `computron serve` stay flat over thousands of model swaps?

Prints exactly one JSON line on stdout; progress goes to stderr.

One ``computron serve`` subprocess (``--tp``/``--pp``, ``max_loaded: 1``) serves tiny random-weight
checkpoints of two families, two of each (OPT and Llama), and a LoRA adapter on the first OPT; short greedy
completions over one persistent HTTP connection go to them in a rotation whose consecutive requests need
different base models, so every request is one swap (one offload and one load, counted from ``/metrics``'
``computron_swaps_total``). ``--extra-model ID=PATH`` adds a checkpoint to the rotation (the slot for a
quantized model). Every answer must equal the model's first answer (greedy): a wrong model's answer fails
the run.

Every ``--every`` swaps the server's whole process tree is measured (psutil): resident memory summed over
the processes, open file descriptors, open regular files, threads and child processes. Drift is each figure
at the end minus its value after the first ``--every`` swaps (the warm-up). Bounds: memory within
``16 MiB`` and ``1 %``, descriptors, files, threads and children ``0``. Swap time: the median request time of
the last 1,000 swaps against the first 1,000 after the warm-up (each request is one swap; within 10 %),
and the same for the engine's own swap seconds from ``/metrics``. ``/metrics`` exposes no pinned or
registered host bytes nor device memory (``pinned_bytes``/``device_bytes`` say so); on CPU there are none.

    .venv/bin/python benchmarks/swap_hygiene.py                       # 10,000 swaps at TP=2
    .venv/bin/python benchmarks/swap_hygiene.py --pp 2 --tp 1 --swaps 2000
    .venv/bin/python benchmarks/swap_hygiene.py --quick               # 300 swaps (the tests' path)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import httpx  # noqa: E402

from served import Server, checkpoints, exit_on_sigterm, log, lora, summed  # noqa: E402

MIB = 1 << 20
MEMORY_BOUND_BYTES = 16 * MIB
MEMORY_BOUND_FRACTION = 0.01
TIME_BOUND = 0.10
PROMPT = "The engine swaps models"
BASES = {"opt-a": ("opt-tiny", 0), "llama-a": ("llama-tiny", 0), "opt-b": ("opt-tiny", 1),
         "llama-b": ("llama-tiny", 1)}
ROTATION = ["opt-a", "llama-a", "opt-b", "opt-a-lora", "llama-b"]
"""Consecutive entries (and the last and the first) run on different bases: every request swaps."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--swaps", type=int, default=10_000)
    p.add_argument("--every", type=int, default=500, help="measure the process tree every this many swaps")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--extra-model", action="append", default=[], metavar="ID=PATH",
                   help="one more checkpoint in the rotation (e.g. a quantized one); repeatable")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=JSON",
                   help="one more engine: setting (YAML value), e.g. metrics_history=1000; repeatable")
    p.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "computron-bench",
                                                 "swap_hygiene-v2"))
    p.add_argument("--quick", action="store_true", help="300 swaps measured every 100, TP=2")
    args = p.parse_args(argv)
    if args.quick:
        args.swaps, args.every = 300, 100
    if args.every < 1 or args.swaps < 2 * args.every:
        p.error("--swaps must be at least twice --every")
    extra = {}
    for item in args.extra_model:
        mid, sep, path = item.partition("=")
        if not sep or not mid or not os.path.isdir(path):
            p.error(f"--extra-model {item!r}: ID=PATH of a checkpoint directory")
        extra[mid] = os.path.abspath(path)
    args.extra_model = extra
    engine = {}
    for item in args.engine:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--engine {item!r}: KEY=VALUE")
        engine[key] = yaml_value(value)
    args.engine = engine
    return args


def yaml_value(text: str):
    import yaml
    return yaml.safe_load(text)


def rotation(extra: Dict[str, str]) -> List[str]:
    """The request order: ``ROTATION``, each extra model after it (an extra model is a base of its own)."""
    return ROTATION + sorted(extra)


def model_entries(args) -> List[dict]:
    root = args.dir
    paths = checkpoints(root, BASES)
    adapter = lora(paths["opt-a"], root, seed=5)
    entries = [{"id": m, "path": p} for m, p in paths.items()]
    entries.append({"id": "opt-a-lora", "base": "opt-a", "adapter": adapter})
    entries += [{"id": m, "path": p} for m, p in sorted(args.extra_model.items())]
    return entries


def window_median(xs: List[float], lo: int, hi: int):
    part = xs[lo:hi]
    return statistics.median(part) if part else None


def drift_row(first: float, last: float, series: List[float], memory: bool) -> dict:
    drift = last - first
    row = {"after_warmup": first, "end": last, "drift": drift, "max_above_warmup": max(series) - first}
    if memory:
        row["drift_fraction"] = drift / first if first else None
        row["pass"] = drift <= MEMORY_BOUND_BYTES and drift <= MEMORY_BOUND_FRACTION * first
    else:
        row["pass"] = drift <= 0
    return row


def run(args) -> dict:
    order = rotation(args.extra_model)
    engine = {"tp": args.tp, "pp": args.pp, "max_loaded": 1, **args.engine}
    server = Server(os.path.join(args.dir, "runs"), model_entries(args), engine)
    samples, latencies, answers = [], [], {}
    leftover: List[int] = []
    try:
        with httpx.Client(timeout=300) as client:
            def sample(done: int):
                m = server.metrics(client)
                row = {"swaps": done, **server.figures(),
                       "loads": int(summed(m, "computron_swaps_total", kind="load")),
                       "swap_seconds": summed(m, "computron_swap_seconds_total"),
                       "t": time.perf_counter()}
                samples.append(row)
                log("swap_hygiene", json.dumps(row))

            start = None
            for i in range(args.swaps + 1):  # request 0 loads the first model: no offload, not counted
                model = order[i % len(order)]
                t0 = time.perf_counter()
                r = client.post(server.url + "/v1/completions",
                                json={"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens,
                                      "temperature": 0})
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    raise RuntimeError(f"request {i} to {model}: {r.status_code} {r.text[:500]}")
                text = r.json()["choices"][0]["text"]
                if answers.setdefault(model, text) != text:
                    raise RuntimeError(f"request {i} to {model} answered {text!r}, its first answer was "
                                       f"{answers[model]!r}")
                if i == 0:
                    start = server.metrics(client)
                    continue
                latencies.append(dt)
                if i % args.every == 0:
                    sample(i)
            answers_distinct = len(set(answers.values()))
    finally:
        leftover = server.stop()
    base_loads = int(summed(start, "computron_swaps_total", kind="load"))
    warm = samples[0]
    figures = {}
    for key in ("rss_bytes", "fds", "open_files", "threads", "children"):
        figures[key] = drift_row(warm[key], samples[-1][key], [s[key] for s in samples], key == "rss_bytes")
    # swap time: request times (one swap each) and the engine's swap seconds per load, first 1,000 after the
    # warm-up against the last 1,000 (shorter runs: as many as there are, up to half the measured swaps)
    span = min(1000, (args.swaps - args.every) // 2)
    first_w, last_w = (args.every, args.every + span), (args.swaps - span, args.swaps)
    t_first, t_last = window_median(latencies, *first_w), window_median(latencies, *last_w)
    by_swaps = {s["swaps"]: s for s in samples}
    engine_ratio = None
    if all(k in by_swaps for k in (*first_w, *last_w)):
        def per_load(a, b):
            sa, sb = by_swaps[a], by_swaps[b]
            return (sb["swap_seconds"] - sa["swap_seconds"]) / max(1, sb["loads"] - sa["loads"])
        engine_ratio = per_load(*last_w) / per_load(*first_w)
    ratio = t_last / t_first
    end = samples[-1]["rss_by_pid"]
    by_process = {("server" if pid == server.proc.pid else f"child {pid}"): end[pid] - rss
                  for pid, rss in warm["rss_by_pid"].items() if pid in end}
    return {
        "swaps": args.swaps, "measured_loads": samples[-1]["loads"] - base_loads,
        "models": order, "distinct_answers": answers_distinct,
        "every": args.every, "drift": figures, "rss_drift_by_process": by_process,
        "swap_time": {"window": span, "first_median_s": t_first, "last_median_s": t_last, "ratio": ratio,
                      "engine_swap_seconds_ratio": engine_ratio, "pass": ratio <= 1 + TIME_BOUND},
        "pinned_bytes": "not exposed by /metrics (on CPU: none pinned)",
        "device_bytes": "not exposed by /metrics (CPU run)",
        "leftover_processes": leftover,
        "series": [{k: s[k] for k in ("swaps", "rss_bytes", "fds", "threads", "children")} for s in samples],
        "seconds": samples[-1]["t"] - samples[0]["t"] if samples else None,
    }


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    result = run(args)
    bounds = {"memory": f"<= {MEMORY_BOUND_BYTES // MIB} MiB and <= {MEMORY_BOUND_FRACTION:.0%}",
              "fds_files_threads_children": "0", "swap_time_ratio": f"<= {1 + TIME_BOUND}"}
    ok = all(r["pass"] for r in result["drift"].values()) and result["swap_time"]["pass"]
    doc = {"benchmark": "swap_hygiene", "tp": args.tp, "pp": args.pp, "max_tokens": args.max_tokens,
           "engine": args.engine, **result, "bounds": bounds, "pass": ok and not result["leftover_processes"],
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    exit_on_sigterm()
    main()
