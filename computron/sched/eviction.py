"""Which idle resident model leaves first: the eviction policies (pure: no torch, no processes).

The scheduler (``scheduler.py``) decides *when* models must leave and *which may* (idle, not pinned,
not just loaded, ...); it evicts a higher ``priority`` last whatever the policy, and among equal
priorities asks the policy here for the order: the candidate with the lowest ``key`` leaves first.
``EngineConfig.eviction`` names the policy (``EVICTIONS``; ``make_eviction`` builds it).

- ``lru``: the least recently used model leaves first (what Ray Serve's multiplexing and ModelMesh do).
- ``cost``: the model whose eviction is expected to cost least per byte of room it frees leaves first,
  GreedyDual-Size style: each model has a value ``H = L + repeat_rate * reload_s / size``, set when it is
  used; the lowest ``H`` leaves, and the floor ``L`` rises to the victim's ``H`` on each eviction, so a
  model that stops being used ages out (newly refreshed models start above its stale value) instead of
  keeping a slot earned long ago. ``reload_s`` is what loading it again takes (its own measured load, or
  its bytes over the measured bandwidth), ``repeat_rate`` its recent request rate not counting the latest
  request (below). Why per byte: room is what evictions buy, so a model must earn its room; dividing by
  the size (GreedyDual-Size) ranks reload seconds saved per byte held, which, where every model loads
  at the same bandwidth, is just how often it is asked for: a big model stays only while it is asked
  for more often than the small ones its room would hold. Without it the policy keeps big models (their
  reload is dear) and thrashes several small ones in their stead. Why not the latest request: a model
  asked for once has shown no rate yet; counting that one request ranks a one-off model, just loaded,
  above models asked for steadily but less recently (the "one-hit wonder" of cache admission).
  ``benchmarks/residency_sim.py`` measured both choices. It also evicts no more than needed: a cheap
  victim that a later, bigger one made unnecessary stays.

Every policy gets the same events (``touch``, ``evicted``, ``note_arrival``, ``record_load``, ``add``,
``remove``); those it has no use for are no-ops.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

HALF_LIFE_S = 30.0
"""Half-life of the request rate estimate of the ``cost`` policy, in seconds. An arrival counts half as
much after this long. Shorter follows shifts in popularity sooner but, for a model asked a few times a
minute, leaves one or two arrivals in the window: too noisy to rank models by (with 10 s, the residency
simulation moved a few percent more bytes on Zipf traces over 8-24 models). Thirty seconds holds about
43 s worth of arrivals (half-life / ln 2), enough to tell a model asked every ten seconds from one asked
every thirty, and a model whose requests stop loses its rank within a couple of minutes."""


class LruEviction:
    """The least recently used candidate leaves first."""

    name = "lru"
    spare_unneeded = False
    """Whether the scheduler keeps victims that a later, bigger victim made unnecessary (LRU: evicts in
    order until the model fits, as it always did)."""

    def __init__(self) -> None:
        self._clock = 0
        self._last_used: Dict[str, int] = {}

    def add(self, m: str) -> None:
        self._last_used[m] = -1

    def remove(self, m: str) -> None:
        self._last_used.pop(m, None)

    def touch(self, m: str, now: Optional[float]) -> None:
        """``m`` was used (loaded, or given a batch); ``now``: the caller's clock, if known."""
        self._clock += 1
        self._last_used[m] = self._clock

    def key(self, m: str) -> Tuple[float, ...]:
        """Lower leaves first."""
        return (self._last_used[m],)

    def evicted(self, m: str) -> None:
        """``m``'s offload was decided."""

    def note_arrival(self, m: str, now: float) -> None:
        """A request for ``m`` was admitted at ``now`` (time.perf_counter())."""

    def record_load(self, m: str, seconds: float, nbytes: int) -> None:
        """``m`` loaded in ``seconds``; ``nbytes``: its size in the scheduler's units (bytes per rank)."""


class CostEviction(LruEviction):
    """GreedyDual-Size on expected reload cost: ``H = L + repeat_rate * reload_s / size``, lowest ``H`` first.

    ``reload_s``: the model's own last measured load time; before it has one, its bytes over the mean
    bandwidth of the loads measured so far; before any load, its bytes (a proxy that ranks models the
    same way). ``rate``: requests per second, an exponentially decayed count of arrivals with half-life
    ``half_life_s``; ``repeat_rate``: the same without the latest arrival (0 for a model asked once).
    ``size``: the model's bytes per rank (1 where unknown). Ties (e.g. models never asked for, or asked
    once) fall back to least recently used.
    """

    name = "cost"
    spare_unneeded = True
    """Evicting a model that is not needed is a cost with no use: once a bigger victim made the room,
    the earlier, smaller ones stay (the most valuable first)."""

    def __init__(self, sizes: Dict[str, int], half_life_s: float = HALF_LIFE_S) -> None:
        super().__init__()
        if not half_life_s > 0:
            raise ValueError(f"half_life_s={half_life_s}: must be > 0")
        self._sizes = sizes  # the scheduler's own dict (bytes per rank), read at each estimate
        self._decay = math.log(2) / half_life_s
        self._count: Dict[str, float] = {}   # decayed arrivals, as of _count_t
        self._count_t: Dict[str, float] = {}
        self._load_s: Dict[str, float] = {}  # last measured load seconds
        self._loaded_bytes = 0.0             # over all measured loads, for the mean bandwidth
        self._loaded_s = 0.0
        self._h: Dict[str, float] = {}
        self._floor = 0.0                    # GreedyDual's L
        self._now: Optional[float] = None    # latest time seen (arrivals, decisions)

    def add(self, m: str) -> None:
        super().add(m)
        self._h[m] = self._floor

    def remove(self, m: str) -> None:
        super().remove(m)
        for d in (self._count, self._count_t, self._load_s, self._h):
            d.pop(m, None)

    def _advance(self, now: Optional[float]) -> None:
        if now is not None and (self._now is None or now > self._now):
            self._now = now

    # ---- estimates -------------------------------------------------------------
    def rate(self, m: str) -> float:
        """Requests per second for ``m`` recently, as of the latest time seen."""
        c = self._count.get(m, 0.0)
        if not c:
            return 0.0
        return self._decay * c * math.exp(-self._decay * max(0.0, self._now - self._count_t[m]))

    def repeat_rate(self, m: str) -> float:
        """``rate`` without the latest arrival: what ``m``'s requests so far say about the next one."""
        c = self._count.get(m, 0.0)
        if c <= 1.0:
            return 0.0
        return self._decay * (c - 1.0) * math.exp(-self._decay * max(0.0, self._now - self._count_t[m]))

    def reload_s(self, m: str) -> float:
        """Expected seconds to load ``m`` again (a byte count before any load was measured)."""
        if m in self._load_s:
            return self._load_s[m]
        size = self._sizes.get(m, 0)
        if self._loaded_s > 0 and self._loaded_bytes > 0:
            return size / (self._loaded_bytes / self._loaded_s)
        return float(size)

    def value(self, m: str) -> float:
        """``H``: the model's GreedyDual value as last refreshed."""
        return self._h[m]

    # ---- events ----------------------------------------------------------------
    def touch(self, m: str, now: Optional[float]) -> None:
        super().touch(m, now)
        self._advance(now)
        self._h[m] = self._floor + self.repeat_rate(m) * self.reload_s(m) / (self._sizes.get(m) or 1)

    def key(self, m: str) -> Tuple[float, ...]:
        return (self._h[m],) + super().key(m)

    def evicted(self, m: str) -> None:
        self._floor = max(self._floor, self._h[m])

    def note_arrival(self, m: str, now: float) -> None:
        self._advance(now)
        c = self._count.get(m, 0.0)
        if c:
            c *= math.exp(-self._decay * max(0.0, now - self._count_t[m]))
        self._count[m] = c + 1.0
        self._count_t[m] = max(now, self._count_t.get(m, now))

    def record_load(self, m: str, seconds: float, nbytes: int) -> None:
        if seconds > 0:
            self._load_s[m] = seconds
            self._loaded_s += seconds
            self._loaded_bytes += nbytes


EVICTIONS = (LruEviction.name, CostEviction.name)


def make_eviction(name: Union[str, LruEviction], sizes: Dict[str, int]) -> LruEviction:
    """The policy called ``name`` (one of ``EVICTIONS``); ``sizes``: the scheduler's bytes per rank. A policy
    object (an ``LruEviction`` or a subclass) is used as it is: how a simulation plugs in a policy that knows
    more than an engine can (``benchmarks/residency_sim.py``'s offline bounds)."""
    if isinstance(name, LruEviction):
        return name
    if name == LruEviction.name:
        return LruEviction()
    if name == CostEviction.name:
        return CostEviction(sizes)
    raise ValueError(f"eviction={name!r}: must be one of {EVICTIONS}")
