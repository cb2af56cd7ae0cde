"""The cluster tier: engine groups on a local Ray cluster, started once per module.

Ray's own processes (GCS, raylet, the actors' worker processes) and the groups' engine workers live as
long as the module's cluster, so the root conftest's per-test leak check cannot apply here: it is
replaced by one at the cluster's teardown (``ray_session``), after the groups are closed and Ray is
shut down, with the same rule: no child process of pytest is left. Without Ray the tier is skipped
(each test module calls ``pytest.importorskip("ray", reason=RAY_MISSING)``).
"""
import psutil
import pytest

RAY_MISSING = "Ray is not installed (pip install -e .[ray]): the cluster tier needs it"


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Per test: nothing (see the module docstring); ``ray_session`` checks at the end of the module."""
    yield


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray cluster of 4 logical CPUs (2 groups of one worker and one master) for the module; at
    its end, every process started meanwhile must be gone."""
    ray = pytest.importorskip("ray", reason=RAY_MISSING)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        from helpers import multiprocessing_servers
        lasting = multiprocessing_servers()  # live as long as pytest
        extra = [p for p in me.children(recursive=True) if p.pid not in before and p.pid not in lasting]
        _, alive = psutil.wait_procs(extra, timeout=30)
        for p in alive:
            p.kill()
        assert not alive, f"the cluster left processes behind: {[(p.pid, p.name()) for p in alive]}"
