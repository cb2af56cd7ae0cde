"""Residency simulator: ``benchmarks/residency.py``'s trace replayed through the real scheduler, in seconds.

The pure ``computron.sched.scheduler.Scheduler`` (so: the real eviction policy, idle eviction, prefetch, overlap and
quantum preemption) is driven by a discrete-event model of the engine around it, on a simulated clock:

- requests arrive as in ``residency.py`` (same Zipf rates and seeded permutation, same Gamma arrivals, same
  prompt lengths and lognormal token counts for a given ``--seed``), each one reported with ``note_arrival``;
- token-level generation as ``engine/token_level.py`` does it: a model's step admits queued requests up to
  ``--max-batch-size`` and gives every running sequence one token (a request's first token comes from the
  step that admitted it); a preempted model's sequences pause and resume when it is back;
- one worker (tp=1) runs commands in the order sent: a load takes ``--load-fixed`` + shard bytes /
  ``--load-bw``; an offload ``--offload-s``; a step ``--step-fixed`` + ``--step-per-byte`` x size, plus
  per sequence and per admitted prompt token terms that also grow with the model's size (larger vocabulary,
  larger head). The defaults were measured on a 2-core CPU (a forward and a state-dict copy of each shape,
  in-process), then scaled by ``--slowdown`` 2 so that LRU on the 8-model trace of seed 0 matches the
  engines side by side (110 loads, TTFT p50 0.14 s and p99 1.3 s measured; 115, 0.11 s, 1.2 s simulated);
  ``residency.py --dump`` writes every swap's and step's times to re-calibrate them;
- the engine warms up as ``residency.py`` does (one request per model, in order) before the replay.

``--bounds`` also replays each trace under two policies no engine can run, to show how far any eviction
policy can get on it: ``rates`` ranks the models by their true request rates (what ``cost`` estimates),
``belady`` knows every future arrival and evicts the model asked for last (Belady's offline policy).

Prints one JSON line: per policy and seed, ``loads``, ``bytes_loaded`` (shard bytes, as ``residency.py``
counts them), ``preemptions``, ``ttft_p50/p99``; per seed ``bytes_moved_ratio`` and ``ttft_p99_ratio``
(cost / lru; each bound's under ``bounds``); over seeds their median, min, max, how many seeds meet each
target (``residency.TARGETS``) and ``both_targets``, for ``cost`` and under ``bounds`` for each bound.

    .venv/bin/python benchmarks/residency_sim.py --seeds 0-9          # the default configuration, 10 seeds
    .venv/bin/python benchmarks/residency_sim.py --seeds 0-19 --bounds  # and what an oracle reaches
    .venv/bin/python benchmarks/residency_sim.py --models 2xopt-small:131072,2xopt-small:32768,4xopt-small
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import os
import statistics
import sys
from collections import deque
from typing import Dict, List, Optional

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

from computron.sched.eviction import LruEviction  # noqa: E402
from computron.sched.scheduler import ActionKind, Reason, Scheduler  # noqa: E402
from residency import FULL, POLICIES, TARGETS, parse_models, zipf_rates  # noqa: E402
from workload import make_trace  # noqa: E402

# name: (hidden, layers, ffn): the zoo's OPT shapes (computron/testing/zoo.py), without importing torch
OPT_SHAPES = {"opt-tiny": (64, 4, 128), "opt-small": (256, 8, 1024), "opt-125m": (768, 12, 3072),
              "opt-350m": (1024, 24, 4096)}
KV_RESERVE = 0.1  # EngineConfig's default


def opt_shard_bytes(name: str, vocab: Optional[int]) -> int:
    """fp32 bytes of a zoo OPT model with tied embeddings (what ``residency.shard_bytes`` counts)."""
    h, n, f = OPT_SHAPES[name]
    vocab = vocab or (512 if name in ("opt-tiny", "opt-small") else 50272)
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    return 4 * (vocab * h + 2050 * h + n * layer + 2 * h)


def requests(trace, seed: int, mean_tokens: float, cap: int, prompt_range) -> List[tuple]:
    """``(arrival, model, prompt_tokens, new_tokens)``, drawn exactly as ``workload.llm_requests`` does
    (with opt-tiny's 512 ids), without importing transformers."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(mean_tokens) - sigma ** 2 / 2
    out = []
    for t, mid in trace:
        n_prompt = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        rng.integers(4, 512, size=n_prompt - 1)  # the prompt's tokens: drawn to keep the stream aligned
        out.append((float(t), mid, n_prompt, int(min(cap, max(1, round(rng.lognormal(mu, sigma)))))))
    return out


class RatesKnown(LruEviction):
    """Bound: the models ranked by their true request rates (what ``cost`` has to estimate), the lowest rate
    leaving first; spares unneeded victims as ``cost`` does. Under Poisson arrivals the rates are all that the
    past tells about the future, so this is what an online policy can hope for at best: ``cost`` with the
    rates known from the start instead of estimated."""

    name = "rates"
    spare_unneeded = True

    def __init__(self, rates: Dict[str, float]):
        super().__init__()
        self._rates = rates

    def key(self, m: str):
        return (self._rates[m],) + super().key(m)


class Belady(LruEviction):
    """Bound: the offline policy that knows every future arrival (Belady's): the model whose next request
    comes last leaves first (one with a request waiting: now). No engine can know this; it shows how far any
    eviction policy can get on a trace."""

    name = "belady"
    spare_unneeded = True

    def __init__(self, sim: "Sim", arrivals: Dict[str, List[float]]):
        super().__init__()
        self._sim = sim
        self._arrivals = arrivals  # per model, sorted

    def key(self, m: str):
        now = self._sim.now
        if self._sim.queue[m]:
            gap = 0.0
        else:
            times = self._arrivals[m]
            i = bisect.bisect_right(times, now)
            gap = times[i] - now if i < len(times) else float("inf")
        return (-gap,) + super().key(m)


BOUNDS = ("rates", "belady")
"""Policies only a simulation can run (``--bounds``): they know what an engine cannot."""


class Sim:
    """One engine (one eviction policy: a name of ``EVICTIONS`` or ``BOUNDS``) on a simulated clock."""

    def __init__(self, args, eviction: str, sizes: Dict[str, int], reqs: List[tuple],
                 rates: Optional[Dict[str, float]] = None):
        self.a = args
        self.sizes = sizes
        self.reqs = reqs
        self.now = float("-inf")
        if eviction == "rates":
            eviction = RatesKnown(rates)
        elif eviction == "belady":
            eviction = Belady(self, {m: sorted(r[0] for r in reqs if r[1] == m) for m in sizes})
        budget = max(int(args.budget_fraction * sum(sizes.values())), max(sizes.values()))
        self.sched = Scheduler(list(sizes), None, prefetch=True, overlap=True, max_inflight=1, policy=args.policy,
                               quantum_s=args.quantum_ms / 1e3, sizes=sizes, device_budget=budget,
                               eviction=eviction)
        self.queue = {m: deque() for m in sizes}
        self.running: Dict[str, Dict[int, int]] = {m: {} for m in sizes}  # request -> tokens still to make
        self.paused_since: Dict[str, Optional[float]] = dict.fromkeys(sizes)
        self.events: list = []
        self.seq = itertools.count()
        self.worker_free = -1e9
        self.ttft: Dict[int, float] = {}
        self.counting = False
        self.loads: List[str] = []
        self.preemptions = 0

    # ---- the engine's side -------------------------------------------------------
    def head(self, m: str) -> Optional[float]:
        times = [self.reqs[self.queue[m][0]][0]] if self.queue[m] else []
        if self.running[m]:
            times.append(self.paused_since[m] if self.paused_since[m] is not None
                         else min(self.reqs[r][0] for r in self.running[m]))
        return min(times) if times else None

    def pump(self, now: float) -> None:
        while True:
            heads = {m: h for m in self.sizes if (h := self.head(m)) is not None}
            actions = self.sched.decide(heads, [m for m in self.sizes if self.running[m]], now)
            if not actions:
                return
            for act in actions:
                m = act.model_id
                if act.kind is ActionKind.LOAD:
                    shard = self.sizes[m] / (1 + KV_RESERVE)
                    self.send(now, "loaded", m, self.a.load_fixed + shard / self.a.load_bw)
                    if self.counting:
                        self.loads.append(m)
                elif act.kind is ActionKind.OFFLOAD:
                    if act.reason is Reason.PREEMPT:
                        self.paused_since[m] = now
                        self.preemptions += self.counting
                    self.send(now, "offloaded", m, self.a.offload_s)
                else:
                    self.paused_since[m] = None
                    admitted = 0
                    while self.queue[m] and len(self.running[m]) < self.a.max_batch_size:
                        r = self.queue[m].popleft()
                        self.running[m][r] = self.reqs[r][3]
                        admitted += self.reqs[r][2]
                    self.send(now, "stepped", m, self.step_s(m, len(self.running[m]), admitted),
                              tuple(self.running[m]))

    def step_s(self, m: str, batch: int, prompt_tokens: int) -> float:
        size, a = self.sizes[m], self.a
        return (a.step_fixed + a.step_per_byte * size + batch * (a.seq_fixed + a.seq_per_byte * size)
                + prompt_tokens * (a.token_fixed + a.token_per_byte * size))

    def send(self, now: float, kind: str, m: str, seconds: float, payload=None) -> None:
        start = max(now, self.worker_free)  # one worker, commands in the order sent
        self.worker_free = start + seconds
        heapq.heappush(self.events, (self.worker_free, next(self.seq), kind, m, (seconds, payload)))

    def arrive(self, r: int, t: float) -> None:
        heapq.heappush(self.events, (t, next(self.seq), "arrival", self.reqs[r][1], (0.0, r)))

    def run(self) -> None:
        while self.events:
            now, _, kind, m, (seconds, payload) = heapq.heappop(self.events)
            self.now = now
            if kind == "arrival":
                self.counting = self.counting or payload >= self.first_counted
                self.queue[m].append(payload)
                self.sched.note_arrival(m, now)
            elif kind == "loaded":
                self.sched.on_loaded(m)
                self.sched.record_load(m, seconds, self.sizes[m])
            elif kind == "offloaded":
                self.sched.on_offloaded(m)
            else:
                self.sched.on_batch_done(m)
                for r in payload:
                    if r not in self.running[m]:
                        continue
                    self.ttft.setdefault(r, now - self.reqs[r][0])
                    self.running[m][r] -= 1
                    if not self.running[m][r]:
                        del self.running[m][r]
            self.pump(now)


def simulate(args, eviction: str, sizes: Dict[str, int], reqs: List[tuple],
             rates: Optional[Dict[str, float]] = None) -> dict:
    warm = [(-30.0 + i, m, 2, 1) for i, m in enumerate(sizes)]  # residency.serve: one request per model, in order
    sim = Sim(args, eviction, sizes, warm + list(reqs), rates)
    sim.first_counted = len(warm)
    for r, req in enumerate(sim.reqs):
        sim.arrive(r, req[0])
    sim.run()
    ttft = [sim.ttft[r] for r in range(len(warm), len(sim.reqs))]
    shard = {m: int(b / (1 + KV_RESERVE)) for m, b in sizes.items()}
    return {"loads": len(sim.loads), "bytes_loaded": sum(shard[m] for m in sim.loads),
            "preemptions": sim.preemptions, "ttft_p50": round(float(np.percentile(ttft, 50)), 4),
            "ttft_p99": round(float(np.percentile(ttft, 99)), 4)}


def seeds(text: str) -> List[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=FULL["models"], help="as residency.py's (OPT shapes of OPT_SHAPES)")
    p.add_argument("--rate", type=float, default=FULL["rate"])
    p.add_argument("--duration", type=float, default=FULL["duration"])
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--budget-fraction", type=float, default=0.5)
    p.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,3,5")
    p.add_argument("--mean-tokens", type=float, default=4.0)
    p.add_argument("--max-tokens-cap", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--policy", default="quantum")
    p.add_argument("--quantum-ms", type=float, default=200.0)
    p.add_argument("--policies", default=",".join(POLICIES), help=f"of {POLICIES + BOUNDS}")
    p.add_argument("--bounds", action="store_true",
                   help=f"also run the policies only a simulation can: {', '.join(BOUNDS)} (see RatesKnown, Belady)")
    g = p.add_argument_group("measured costs (seconds; sizes in bytes per rank with the KV reserve)")
    g.add_argument("--load-fixed", type=float, default=0.005)
    g.add_argument("--load-bw", type=float, default=1.3e9, help="bytes/s of a load")
    g.add_argument("--offload-s", type=float, default=0.003)
    g.add_argument("--step-fixed", type=float, default=0.007)
    g.add_argument("--step-per-byte", type=float, default=1.5e-10)
    g.add_argument("--seq-fixed", type=float, default=1e-4)
    g.add_argument("--seq-per-byte", type=float, default=2.2e-11)
    g.add_argument("--token-fixed", type=float, default=7e-5)
    g.add_argument("--token-per-byte", type=float, default=9.7e-12)
    g.add_argument("--slowdown", type=float, default=2.0, help="multiplies every load, offload and step time")
    g.add_argument("--per-seed", action="store_true", help="also print each seed's figures")
    args = p.parse_args(argv)
    for k in ("load_fixed", "offload_s", "step_fixed", "step_per_byte", "seq_fixed", "seq_per_byte", "token_fixed",
              "token_per_byte"):
        setattr(args, k, getattr(args, k) * args.slowdown)
    args.load_bw /= args.slowdown
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.policies += [b for b in BOUNDS if args.bounds and b not in args.policies]
    unknown = [x for x in args.policies if x not in POLICIES + BOUNDS]
    if unknown or not args.policies:
        p.error(f"--policies {unknown or ''}: a comma-separated subset of {POLICIES + BOUNDS}")
    return args


RATIOS = (("bytes_moved_ratio", "bytes_loaded"), ("ttft_p99_ratio", "ttft_p99"))


def ratios(run: dict, policy: str) -> dict:
    """``policy``'s figures over LRU's in one run (none where LRU moved nothing: every model fit)."""
    return {key: round(run[policy][field] / run["lru"][field], 3) for key, field in RATIOS
            if "lru" in run and policy in run and run["lru"][field]}


def over_seeds(per_seed: List[dict]) -> dict:
    """Each ratio's median, min, max and how many seeds meet its target; ``both_targets``: seeds meeting both."""
    out = {}
    for key, _ in RATIOS:
        xs = [r[key] for r in per_seed if key in r]
        if xs:
            out[key] = {"median": round(statistics.median(xs), 3), "min": min(xs), "max": max(xs),
                        "meets_target": sum(x <= TARGETS[key] for x in xs), "of": len(xs)}
    both = [r for r in per_seed if all(key in r for key, _ in RATIOS)]
    if both:
        out["both_targets"] = sum(all(r[key] <= TARGETS[key] for key, _ in RATIOS) for r in both)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    models = parse_models(args.models)
    sizes = {mid: int(opt_shard_bytes(name, v) * (1 + KV_RESERVE)) for mid, name, v in models}
    ids = list(sizes)
    policies = args.policies
    runs = []
    for seed in seeds(args.seeds):
        rates = zipf_rates(len(ids), args.rate, args.zipf, seed)
        trace = make_trace(list(rates), args.cv, args.duration, seed, ids)
        reqs = requests(trace, seed + 1, args.mean_tokens, args.max_tokens_cap, (args.prompt_min, args.prompt_max))
        run = {"seed": seed, **{pol: simulate(args, pol, sizes, reqs, dict(zip(ids, rates))) for pol in policies}}
        run.update(ratios(run, "cost"))
        bounds = {b: ratios(run, b) for b in BOUNDS if b in policies}
        if bounds:
            run["bounds"] = bounds
        if args.per_seed:
            print(json.dumps(run), file=sys.stderr)
        runs.append(run)
    doc = {"simulator": "residency", "models": args.models, "sizes": sizes, "rate": args.rate,
           "duration_s": args.duration, "zipf": args.zipf, "cv": args.cv, "budget_fraction": args.budget_fraction,
           "seeds": [r["seed"] for r in runs], **over_seeds(runs)}
    bounds = [b for b in BOUNDS if b in policies]
    if bounds:
        doc["bounds"] = {b: over_seeds([r["bounds"][b] for r in runs]) for b in bounds}
    for pol in policies:
        doc[pol] = {k: round(statistics.mean(r[pol][k] for r in runs), 3)
                    for k in ("loads", "preemptions", "ttft_p50", "ttft_p99")}
    doc["runs"] = runs
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
