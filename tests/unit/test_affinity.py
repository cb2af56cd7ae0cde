"""Which cores a worker is pinned to (``runtime/affinity.py``): the policy, no process."""
import pytest

from computron.runtime.affinity import worker_cores

pytestmark = pytest.mark.unit


def test_worker_cores_leave_the_first_core_to_the_master():
    assert worker_cores("auto", [0, 1], 0, 1, 1) == [1]
    assert worker_cores("auto", range(8), 0, 2, 3) == [2, 3, 4] and worker_cores("auto", range(8), 1, 2, 3) == [5, 6, 7]
    assert worker_cores("auto", [0, 1], 0, 2, 1) is None      # 2 workers + the master on 2 cores: not pinned
    assert worker_cores("off", range(8), 0, 1, 1) is None
    with pytest.raises(ValueError, match="pin_workers='on'"):
        worker_cores("on", [0, 1], 0, 1, 1)
