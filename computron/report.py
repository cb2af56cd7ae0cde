"""Human-readable summaries of ``engine.metrics()`` for examples and experiments."""
from __future__ import annotations

import statistics
from typing import Iterable, List


def swap_table(records: Iterable) -> str:
    """One line per load/offload: model, engine-side time, slowest and fastest rank."""
    lines = [f"{'swap':8} {'model':10} {'engine ms':>10} {'ranks ms (min..max)':>20} {'MB moved':>9}"]
    for r in records:
        if r.kind not in ("load", "offload"):
            continue
        d = list(r.rank_durations.values()) or [0.0]
        moved = f"{r.nbytes / 2**20:9.1f}" if r.kind == "load" else f"{'-':>9}"
        lines.append(f"{r.kind:8} {r.model_id:10} {r.duration * 1e3:10.2f} "
                     f"{min(d) * 1e3:9.2f}..{max(d) * 1e3:<9.2f} {moved}")
    return "\n".join(lines)


def summary(records: List) -> str:
    """Means of load, offload, batch and request times."""
    out = []
    for kind in ("load", "offload", "batch", "request"):
        xs = [(r.latency if kind == "request" else r.duration) for r in records if r.kind == kind]
        if xs:
            out.append(f"{kind:8} n={len(xs):4d} mean {statistics.fmean(xs) * 1e3:8.2f} ms  "
                       f"max {max(xs) * 1e3:8.2f} ms")
    return "\n".join(out)
