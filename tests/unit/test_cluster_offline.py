"""The offline yardsticks of a routed trace (``cluster/offline.py``): Belady's fewest loads and the time a group
sat idle while another queued."""
import itertools

import pytest

from computron.cluster.offline import fewest_loads, idle_while_queued


def brute_force(models, slots, resident=()):
    """The fewest loads over every eviction choice (small inputs only)."""
    best = [float("inf")]

    def go(i, held, loads):
        if loads >= best[0]:
            return
        if i == len(models):
            best[0] = loads
            return
        m = models[i]
        if m in held:
            return go(i + 1, held, loads)
        if len(held) < slots:
            return go(i + 1, held | {m}, loads + 1)
        for v in held:
            go(i + 1, (held - {v}) | {m}, loads + 1)
    go(0, frozenset(resident), 0)
    return best[0]


def test_fewest_loads_is_the_offline_optimum():
    assert fewest_loads(list("abcabc"), 2) == 4  # a b c (evict b: a comes first), a, b (evict ...), c
    assert fewest_loads(list("aaaa"), 1, resident=["a"]) == 0
    assert fewest_loads(list("abab"), 2) == 2 and fewest_loads(list("abab"), 1) == 4
    for seq in itertools.product("abcd", repeat=5):
        for slots in (1, 2, 3):
            assert fewest_loads(seq, slots, resident="ab"[:slots]) == brute_force(seq, slots, "ab"[:slots]), seq


def test_fewest_loads_errors_name_the_field():
    with pytest.raises(ValueError, match="slots=0"):
        fewest_loads(["a"], 0)
    with pytest.raises(ValueError, match=r"resident=\['a', 'b'\]: more models than slots=1"):
        fewest_loads(["a"], 1, ["a", "b"])


def test_idle_while_queued_counts_only_an_idle_group_beside_a_queue():
    # group 0 runs a and b at once (one slot: a queue) from 0 to 4; group 1 is idle until 3, then busy
    reqs = [(0, "a", 0.0, 4.0), (0, "b", 1.0, 4.0), (1, "c", 3.0, 5.0)]
    assert idle_while_queued(reqs, 2, max_loaded=1, max_batch=8) == 2.0  # 1..3
    assert idle_while_queued(reqs, 2, max_loaded=2, max_batch=8) == 0.0  # two slots: no queue
    # one model, more requests than a batch holds: a queue too
    reqs = [(0, "a", 0.0, 2.0)] * 3
    assert idle_while_queued(reqs, 2, max_loaded=1, max_batch=2) == 2.0
