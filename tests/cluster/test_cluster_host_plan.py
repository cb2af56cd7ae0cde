"""The front plans which models each engine group keeps in host memory (issue 21), on a local Ray cluster.

Two groups (TP=1, ``max_loaded=1``) serve three tiny OPT checkpoints with ``host_budget`` room for one
shard each: two host copies for three models. The launch plan (equal rates) keeps the first two by name;
after a trace of one model only, the front plans again and the hot model's group reads it ahead and keeps it.
"""
import asyncio
import os
import threading

import pytest
from helpers import greedy_reference

pytest.importorskip("ray", reason="Ray is not installed (pip install -e .[ray]): the cluster tier needs it")
pytestmark = pytest.mark.timeout(400)

NAMES = ["opt0", "opt1", "opt2"]
PROMPT = [2, 100, 200, 300]


@pytest.fixture(scope="module")
def cluster(ray_session, checkpoints):
    from computron import EngineConfig, ModelConfig, zoo
    from computron.cluster.placement import HostPlacement
    from computron.cluster.serve import start_cluster
    configs = [ModelConfig(m, zoo.load_causal_lm, {"path": checkpoints[m]}) for m in NAMES]
    shard = os.path.getsize(os.path.join(checkpoints["opt0"], "model.safetensors"))
    config = EngineConfig(max_loaded=1, host_budget=int(1.5 * shard), heartbeat_timeout_s=30)
    c = start_cluster(config, configs, 2, max_restarts=0, placement=HostPlacement(2, min_interval_s=0.5))
    try:
        yield c
    finally:
        c.close()


def test_the_hot_model_is_kept_in_host_memory_where_the_plan_says(cluster, checkpoints):
    launch = cluster.host_plan()["planned"]
    assert sorted(m for ms in launch.values() for m in ms) == ["opt0", "opt1"], launch  # equal rates: by name
    seen = threading.Event()
    found = {}

    def kept_where_planned(group, upd):
        """Every group the plan gives opt2 keeps it by plan, in host memory (or on its device), and no other."""
        if upd is None:
            return
        planned = {g for g, ms in cluster.host_plan()["planned"].items() if "opt2" in ms}
        groups = cluster.snapshot().groups
        holding = {g for g, s in groups.items() if s.alive and s.models["opt2"].host_plan}
        if planned and holding == planned and all(groups[g].models["opt2"].tier != "disk" for g in planned):
            found.update(planned=planned, states={g: cluster.group_states()[g]["state"] for g in planned})
            seen.set()
    cluster.add_observer(kept_where_planned)

    async def trace():
        return [await cluster.submit("opt2", {"input_ids": PROMPT, "max_tokens": 4}) for _ in range(12)]
    outs = asyncio.run(trace())
    ref = greedy_reference(checkpoints["opt2"], PROMPT, 4).tolist()
    assert all(o.tolist() == ref for o in outs)
    assert seen.wait(120), (cluster.host_plan(), {g: {m: (s.tier, s.host_plan) for m, s in snap.models.items()}
                                                  for g, snap in cluster.snapshot().groups.items()})
    for g, state in found["states"].items():  # the router sees the planned copy (or the model on the device)
        assert "opt2" in state.host | state.resident | state.loading, state
    print(f"\nlaunch plan {launch}; after 12 requests of opt2: {cluster.host_plan()}")
