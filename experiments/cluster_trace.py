"""A trace over 4 models replayed through 2 engine groups on Ray: the router's loads against the fewest any
placement needed for that trace, and whether one group sat idle while the other queued (issue 37).

    .venv/bin/python experiments/cluster_trace.py                          # a local Ray cluster, ~1 minute
    .venv/bin/python experiments/cluster_trace.py --ray-address 10.200.0.1:6379   # the two-node recipe's cluster

The trace is ``cluster_run.make_trace`` (Gamma arrivals per model, Zipf shares, seeded); every request is
submitted through the ``ClusterEngine`` at its arrival time (non-streamed, greedy) from the moment the groups
are up (no warm-up: the first loads count). The router is the swap-aware one, recording each request's group.

Printed: one JSON line. ``router_loads`` (the groups' own load counters over the trace), ``fewest_loads``
(``cluster.offline.fewest_loads``: Belady's offline optimum over the groups' slots taken together, requests
in arrival order, from the models resident when the trace started), their ``ratio``; ``idle_while_queued_s``
(``cluster.offline.idle_while_queued``) and the trace's ``span_s``; requests per group; the machine's load.
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cluster_run import _loads, models_trace_and_ray, trace_arguments  # noqa: E402

from computron.cluster.offline import fewest_loads, idle_while_queued  # noqa: E402
from computron.cluster.policy import SwapAwareRouter  # noqa: E402

_REQUEST: contextvars.ContextVar = contextvars.ContextVar("request", default=None)


class RecordingRouter(SwapAwareRouter):
    """The swap-aware router, noting the group of each request (by the request index in the caller's context)."""

    def __init__(self, n_groups: int):
        super().__init__(n_groups)
        self.groups = {}

    def route(self, model_id, tokens, now, exclude=()):
        g = super().route(model_id, tokens, now, exclude)
        self.groups[_REQUEST.get()] = g
        return g


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trace_arguments(ap, "opt-tiny", 30.0, "seconds of arrivals")
    ap.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    ap.add_argument("--out", default=None, help="also write the JSON document here")
    args = ap.parse_args(argv)

    from computron import EngineConfig
    from computron.cluster.serve import start_cluster
    models, configs, trace, started_ray = models_trace_and_ray(args)
    import ray
    router = RecordingRouter(args.groups)
    cluster = start_cluster(EngineConfig(max_loaded=args.max_loaded, max_batch_size=args.max_batch), configs,
                            args.groups, router=router)
    try:
        snap = cluster.snapshot()
        resident = [m for m, s in snap.models.items() for g, st in s.groups.items() if st == "loaded"]
        loads0 = _loads(cluster)
        spans = {}

        async def run():
            t0 = time.perf_counter()

            async def one(i, t, m, ids, n):
                await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))  # the trace's arrival time
                _REQUEST.set(i)
                start = time.perf_counter() - t0
                out = await cluster.submit(m, {"input_ids": ids, "max_tokens": n})
                assert len(out) == n, (m, n, len(out))
                spans[i] = (start, time.perf_counter() - t0)
            await asyncio.gather(*(one(i, *a) for i, a in enumerate(trace)))

        asyncio.run(run())
        loads = {g: n - loads0.get(g, 0) for g, n in _loads(cluster).items()}
        nodes = {i: s["node"] for i, s in cluster.group_states().items()}
    finally:
        cluster.close()
        if started_ray:
            ray.shutdown()
    reqs = [(router.groups[i], m, *spans[i]) for i, (t, m, ids, n) in enumerate(trace)]
    best = fewest_loads([m for _, m, _, _ in trace], args.groups * args.max_loaded, resident)
    total = sum(loads.values())
    doc = {"experiment": "cluster_trace", "groups": args.groups, "models": len(models), "model": args.model,
           "max_loaded": args.max_loaded, "requests": len(trace), "router": "swap-aware",
           "router_loads": total, "loads_per_group": loads, "fewest_loads": best,
           "ratio": round(total / best, 3) if best else None, "resident_at_start": sorted(resident),
           "requests_per_group": {g: sum(1 for r in reqs if r[0] == g) for g in range(args.groups)},
           "idle_while_queued_s": round(idle_while_queued(reqs, args.groups, args.max_loaded, args.max_batch), 3),
           "span_s": round(max(e for *_, e in reqs), 3), "nodes": nodes,
           "run": {k: getattr(args, k) for k in ("rate", "zipf", "cv", "duration", "mean_tokens", "seed",
                                                 "max_batch", "ray_address")},
           "load_average": os.getloadavg()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f)
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
