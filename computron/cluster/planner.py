"""Which models each group keeps in host memory: a greedy placement (pure: no torch, no Ray, no processes).

A model in a group's host memory loads onto that group's devices at the host link's speed; one that is not
must be read from disk first. Host memory is bounded per group (``host_budget``, bytes), so the planner
decides which models get a host copy where, to save the most swap seconds per second of traffic.

The rule follows AlpaServe's greedy placement (OSDI'23, its "greedy model placement" algorithm) in spirit:
candidate copies are taken one at a time, best gain first, while they fit. AlpaServe scores a candidate by
re-simulating SLO attainment and places (model, group) pairs in one pass; here the gain is in closed form,
and which copies to keep is decided before where they go, so that re-planning can leave copies in place:

- a model's first host copy saves ``rate x load_s`` swap seconds per second (every load of it becomes a
  host load), per byte of host memory it takes: first copies are taken in order of ``rate x load_s / size``;
- a second copy on another group matters only when the router gives the model a second group, i.e. when
  it is hot: its gain is the first copy's times ``min(1, rate / fair_rate)`` halved, where ``fair_rate`` is
  the total rate over the groups. At most ``max_copies`` copies per model (2 by default). Second copies
  come after every first copy that fits: a model with no host copy pays a disk read on each of its loads
  (seconds: a certain TTFT miss), while a missing second copy costs only when the router replicates, and
  the rate estimates of rarely used models are too noisy to trade their only copy for someone's second.
- which copies: in that order, while the groups' host memory still has room for them in all (the copies of
  a model are spread over distinct groups, so at most one per group);
- where: first, each chosen copy stays on a group that held the model in ``previous`` if that group has
  room and its placed rate (the traffic of the models placed there, a model's rate split evenly over its
  copies) stays within ``1 + STAY_SLACK`` times a fair share (total rate / groups): re-planning moves few
  copies, each move being a disk read, and never for the noise of a rate estimate; then the other copies,
  busiest model first (longest-processing-time order, which balances best), each to the group with room
  whose placed rate is lowest (hot models spread over the groups, and with them their traffic), then the
  one with the most room left. A copy that fits nowhere (the groups' room is in pieces: budgets that are
  not multiples of the sizes, copies that stayed) takes the place of copies of less gain on one group, the
  least gain per byte first, where that loses the least gain, if it gains ``1 + STAY_SLACK`` times more than
  it takes out (no move for the noise of a rate); else it is left out. Without this, a model that was never
  requested and stayed put would keep out the copy of a model that became hot.

Re-planning: the caller calls ``plan`` again with fresh rates (e.g. every few seconds with rates counted
over a recent window) and applies the difference.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Set

__all__ = ["plan", "STAY_SLACK"]

STAY_SLACK = 0.25
"""How far above a fair share of the traffic a group's placed rate may go for a copy to stay where it was."""


def plan(rates: Mapping[str, float], sizes: Mapping[str, int], load_s: Mapping[str, float],
         host_budget: Mapping[int, int], *, previous: Optional[Mapping[int, Set[str]]] = None,
         max_copies: int = 2) -> Dict[int, Set[str]]:
    """Group -> the models it should keep in host memory (every group of ``host_budget`` is a key).

    ``rates``: requests/s per model (a model missing or at rate 0 gets a copy only if room is left over);
    ``sizes``: bytes per model in one group's host memory; ``load_s``: seconds a load of the model costs
    more without a host copy (its disk read); ``host_budget``: bytes of host memory per group;
    ``previous``: the placement in force (its copies stay where they are unless that unbalances the traffic).
    """
    if max_copies < 1:
        raise ValueError(f"max_copies={max_copies}: must be >= 1")
    missing = sorted(m for m in set(rates) | set(load_s) if m not in sizes)
    if missing:
        raise ValueError(f"sizes has no entry for models {missing}")
    bad = {m: s for m, s in sizes.items() if s <= 0}
    if bad:
        raise ValueError(f"sizes must be > 0 bytes: {bad}")
    neg = {g: b for g, b in host_budget.items() if b < 0}
    if neg:
        raise ValueError(f"host_budget must be >= 0 bytes: {neg}")
    previous = previous or {}
    models = sorted(sizes)
    total_rate = sum(max(0.0, float(rates.get(m, 0.0))) for m in models)
    fair_rate = total_rate / max(1, len(host_budget))

    items = []  # (gain per byte, gain, model, copy index)
    for m in models:
        r = max(0.0, float(rates.get(m, 0.0)))
        gain = r * max(0.0, float(load_s.get(m, 0.0)))
        items.append((gain / sizes[m], gain, m, 0))
        hot = min(1.0, r / fair_rate) if fair_rate > 0 else 0.0
        for k in range(1, min(max_copies, len(host_budget))):
            g2 = gain * hot / (2 * k)
            if g2 > 0:
                items.append((g2 / sizes[m], g2, m, k))
    # first copies before second ones, then best density, the bigger gain, the name (deterministic)
    items.sort(key=lambda it: (it[3], -it[0], -it[1], it[2]))
    room_left = sum(int(b) for b in host_budget.values())
    chosen = []
    for _, _, m, k in items:
        if sizes[m] <= room_left:
            chosen.append((m, k))
            room_left -= sizes[m]

    free = {g: int(b) for g, b in host_budget.items()}
    placed_rate = {g: 0.0 for g in host_budget}
    out: Dict[int, Set[str]] = {g: set() for g in host_budget}
    holders: Dict[str, list] = {}
    cap = fair_rate * (1 + STAY_SLACK)

    def put(m: str, g: int) -> None:
        r = max(0.0, float(rates.get(m, 0.0)))
        hs = holders.setdefault(m, [])
        for h in hs:  # each holder's share of the model's traffic shrinks from r/k to r/(k+1)
            placed_rate[h] -= r / len(hs) - r / (len(hs) + 1)
        hs.append(g)
        placed_rate[g] += r / len(hs)
        out[g].add(m)
        free[g] -= sizes[m]

    def share(m: str) -> float:
        return max(0.0, float(rates.get(m, 0.0))) / (len(holders.get(m, ())) + 1)

    def take(m: str, g: int) -> None:  # put's inverse
        r = max(0.0, float(rates.get(m, 0.0)))
        hs = holders[m]
        placed_rate[g] -= r / len(hs)
        hs.remove(g)
        for h in hs:
            placed_rate[h] += r / len(hs) - r / (len(hs) + 1)
        out[g].discard(m)
        free[g] += sizes[m]

    gain_of = {(m, k): gain for _, gain, m, k in items}
    copy_gain: Dict[int, Dict[str, float]] = {g: {} for g in host_budget}  # the gain of each placed copy

    def place(m: str, k: int, g: int) -> None:
        put(m, g)
        copy_gain[g][m] = gain_of[(m, k)]

    def displace(m: str, k: int) -> None:
        """Make room for copy ``k`` of ``m`` on one group by taking out copies of less gain (see above)."""
        gain, best = gain_of[(m, k)], None
        for g in sorted(out):
            if m in out[g]:
                continue
            weaker = sorted((x for x in out[g] if copy_gain[g][x] < gain),
                            key=lambda x: (copy_gain[g][x] / sizes[x], x))
            room, drop = free[g], []
            for x in weaker:
                if room >= sizes[m]:
                    break
                drop.append(x)
                room += sizes[x]
            lost = sum(copy_gain[g][x] for x in drop)
            if room >= sizes[m] and lost * (1 + STAY_SLACK) < gain and (best is None or lost < best[0]):
                best = (lost, g, drop)
        if best is not None:
            for x in best[2]:
                take(x, best[1])
                del copy_gain[best[1]][x]
            place(m, k, best[1])

    later = []
    for m, k in chosen:  # copies that stay where they were
        stay = [h for h in sorted(out) if m in previous.get(h, ()) and m not in out[h] and free[h] >= sizes[m]
                and placed_rate[h] + share(m) <= cap]
        if stay:
            place(m, k, min(stay, key=lambda h: placed_rate[h]))
        else:
            later.append((m, k))
    later.sort(key=lambda mk: -max(0.0, float(rates.get(mk[0], 0.0))))  # busiest first: the best balance (LPT)
    for m, k in later:  # the others, where the traffic is lowest
        room = [g for g in out if m not in out[g] and free[g] >= sizes[m]]
        if room:
            place(m, k, min(room, key=lambda g: (placed_rate[g], -free[g], g)))
        else:
            displace(m, k)
    return out
