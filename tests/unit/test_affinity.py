"""Which cores a worker is pinned to and how many helper threads it gets, where (``runtime/affinity.py``): the
policy, no process."""
import pytest

from computron.runtime.affinity import MAX_HELPERS, claim_order, helper_cores, helper_count, worker_cores

pytestmark = pytest.mark.unit


def test_worker_cores_leave_the_first_core_to_the_master():
    assert worker_cores("auto", [0, 1], 0, 1, 1) == [1]
    assert worker_cores("auto", range(8), 0, 2, 3) == [2, 3, 4] and worker_cores("auto", range(8), 1, 2, 3) == [5, 6, 7]
    assert worker_cores("auto", [0, 1], 0, 2, 1) is None      # 2 workers + the master on 2 cores: not pinned
    assert worker_cores("off", range(8), 0, 1, 1) is None
    with pytest.raises(ValueError, match="pin_workers='on'"):
        worker_cores("on", [0, 1], 0, 1, 1)


def test_helpers_only_for_one_thread_workers_on_the_cores_no_worker_holds():
    assert helper_count(True, 2, 1, 1) == 1 and helper_count(True, 3, 1, 1) == 2
    assert helper_count(True, 2, 2, 1) == 0                            # TP=2 on 2 cores: none spare
    assert helper_count(True, 8, 2, 1) == 3 and helper_count(True, 32, 1, 1) == MAX_HELPERS
    assert helper_count(True, 8, 1, 2) == 0                            # two intra-op threads: oneDNN's
    assert helper_count(False, 2, 1, 1) == 0 and helper_count(True, 1, 1, 1) == 0
    assert worker_cores("auto", [0, 1], 0, 1, 1) == [1] and helper_cores(1, [0, 1], [1], []) == [0]
    assert helper_cores(3, range(8), [7], [6, 5]) == [0, 1, 2, 3, 4] and helper_cores(0, [0, 1], [1], []) == []
    assert claim_order(range(4), 0, 1, 1) == [3, 2, 1]                # never the master's core 0
    assert claim_order(range(8), 0, 2, 2) == [4, 5, 7, 6, 3, 2, 1]
