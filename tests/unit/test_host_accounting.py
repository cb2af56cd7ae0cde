"""A worker's one count of host memory (``HostTier._host_used``): builds at start-up, models added while
serving and reads ahead all check ``host_budget`` against it, and each holds its room while it reads."""
import threading
from types import SimpleNamespace

from computron.worker.host_tier import _NO_ROOM, HostTier


class FakeStore:
    """A shard of ``nbytes`` on disk (``host`` False) or in host memory, never on the device."""

    def __init__(self, nbytes: int, host: bool = False):
        self.nbytes, self.host_numels = nbytes, {}
        self.host_resident, self.resident, self.last_used = host, False, 0.0

    def host_bytes(self) -> int:
        return self.nbytes if self.host_resident else 0

    @property
    def evictable(self) -> bool:
        return self.host_resident

    def release_host(self) -> int:
        self.host_resident = False
        return self.nbytes


class Tier(HostTier):
    def __init__(self, budget: int, stores):
        self.rank, self.config, self.stores, self.host_pool = 0, SimpleNamespace(host_budget=budget), stores, None
        self._host_lock = threading.Lock()
        self.host_kept, self._reading_ahead, self._building = frozenset(), {}, {}


def test_an_add_during_a_read_ahead_does_not_overrun_the_budget():
    tier = Tier(100, {"planned": FakeStore(60)})
    tier.host_kept = frozenset({"planned"})
    with tier._host_lock:
        store = tier._claim_read_ahead("planned")  # its read is in flight: 60 bytes on the way
    assert store is tier.stores["planned"] and tier._host_used() == 60
    assert not tier._reserve_host("added", 50)  # the add goes to disk: 60 + 50 would be over 100
    assert tier._reserve_host("small", 40) and tier._host_used() == 100
    tier._settle_host("small")
    assert tier._host_used() == 60


def test_a_read_ahead_during_an_add_finds_no_room_the_add_holds():
    tier = Tier(100, {"planned": FakeStore(60)})
    tier.host_kept = frozenset({"planned"})
    assert tier._reserve_host("added", 50)  # the add reads its shard now
    with tier._host_lock:
        assert tier._claim_read_ahead("planned") is _NO_ROOM
    tier.stores = {**tier.stores, "added": FakeStore(50, host=True)}
    tier._settle_host("added")  # the built store counts its own bytes: counted once, not twice
    assert tier._host_used() == 50
    with tier._host_lock:  # the added model is not planned: it goes to disk to make room for the planned one
        assert tier._claim_read_ahead("planned") is tier.stores["planned"]
    assert not tier.stores["added"].host_resident and tier._host_used() == 60


def test_start_up_builds_count_what_they_hold_until_the_budget_is_full():
    tier = Tier(100, {})
    fits = []
    for mid, n in (("a", 40), ("b", 50), ("c", 20), ("d", 10)):
        ok = tier._reserve_host(mid, n)
        fits.append(ok)
        tier.stores[mid] = FakeStore(n, host=ok)
        tier._settle_host(mid)
    assert fits == [True, True, False, True] and tier._host_used() == 100


def test_no_budget_means_every_build_fits():
    tier = Tier(None, {"x": FakeStore(10**12, host=True)})
    assert tier._reserve_host("y", 10**12)
