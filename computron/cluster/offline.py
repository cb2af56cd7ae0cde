"""Offline yardsticks for a routed trace (pure: no Ray, no clock): what the router did, judged after the fact.

- ``fewest_loads``: the fewest loads any placement over ``groups x max_loaded`` device slots needs for a
  request sequence served in arrival order (Belady's rule on the slots taken together: on a miss, evict the
  model whose next request is farthest away). Moving a model between groups costs a load too, so the slots
  of several groups are no better than one cache of as many slots: a lower bound for any router.
- ``idle_while_queued``: the seconds one group had nothing in flight while another had work it could not run
  at once (requests of more models than its slots, or more requests than its batch).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Sequence, Tuple

__all__ = ["fewest_loads", "idle_while_queued"]


def fewest_loads(models: Sequence[str], slots: int, resident: Iterable[str] = ()) -> int:
    """Loads Belady's offline rule needs for ``models`` (requests in order) over ``slots`` slots holding
    ``resident`` at the start (at most ``slots`` of them)."""
    if slots < 1:
        raise ValueError(f"slots={slots}: must be >= 1")
    held = list(dict.fromkeys(resident))
    if len(held) > slots:
        raise ValueError(f"resident={held}: more models than slots={slots}")
    nxt: List[float] = [0.0] * len(models)
    upcoming: Dict[str, float] = {}
    for i in range(len(models) - 1, -1, -1):  # the index of each request's model's next request
        nxt[i] = upcoming.get(models[i], float("inf"))
        upcoming[models[i]] = i
    when = {m: upcoming.get(m, float("inf")) for m in held}  # each held model's next request
    loads = 0
    for i, m in enumerate(models):
        if m not in when:
            loads += 1
            if len(when) >= slots:
                del when[max(when, key=when.get)]
        when[m] = nxt[i]
    return loads


def idle_while_queued(requests: Iterable[Tuple[int, str, float, float]], n_groups: int, max_loaded: int,
                      max_batch: int) -> float:
    """Seconds during which some group had no request in flight while another had more distinct models in
    flight than ``max_loaded`` or more requests than ``max_batch`` x ``max_loaded``. ``requests``:
    ``(group, model, start, end)`` as the front saw them (routed, answered)."""
    events = sorted((t, kind, g, m) for g, m, s, e in requests for t, kind in ((s, 1), (e, -1)))
    inflight: List[Dict[str, int]] = [defaultdict(int) for _ in range(n_groups)]
    idle_s, last = 0.0, None
    for t, kind, g, m in events:
        if last is not None and t > last:
            counts = [sum(c.values()) for c in inflight]
            queued = [len([v for v in c.values() if v > 0]) > max_loaded or n > max_batch * max_loaded
                      for c, n in zip(inflight, counts)]
            if any(n == 0 for n in counts) and any(queued):
                idle_s += t - last
        inflight[g][m] += kind
        last = t
    return idle_s
