"""Engine groups on Ray, started for ``computron serve --ray --groups N [--ray-address ADDR]`` or a program.

    init_ray(address)          join a running cluster (``ray start --head`` elsewhere), or start a local one
    start_cluster(...)         N ``EngineGroup`` actors (``groups.py``) + a router + the ``ClusterEngine``

``server.serving.serve_cluster`` serves HTTP over the started ``ClusterEngine``.

Every group serves every model of the config with ``tp x pp`` workers of its own (one node per group);
the router (``policy.SwapAwareRouter`` by default) picks a group per request. Ray is an optional
dependency (``pip install -e .[ray]``); on a cluster, computron and the checkpoints must be on every
node at the same paths.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

log = logging.getLogger("computron.cluster")

RAY_MISSING = "--ray needs Ray, which is not installed: pip install -e .[ray]  (or: pip install 'ray>=2.40')"
ROUTERS = ("swap-aware", "round-robin")


class RayMissingError(ImportError):
    pass


def _ray():
    try:
        import ray
    except ImportError:
        raise RayMissingError(RAY_MISSING) from None
    return ray


def init_ray(address: Optional[str] = None, **kwargs) -> bool:
    """Join the cluster at ``address`` ('auto': the one this node belongs to), or start a local one;
    nothing when Ray is already initialized. Returns whether this call started Ray (then the caller
    shuts it down). ``RayMissingError`` (saying how to install it) without Ray."""
    ray = _ray()
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, **kwargs)
        log.info("joined the Ray cluster at %s: %s", address, ray.cluster_resources())
    else:
        ray.init(**kwargs)
        log.info("started a local Ray cluster: %s", ray.cluster_resources())
    return True


def make_router(router: Union[str, Any], n_groups: int):
    """A router of ``policy.py`` by name ('swap-aware', 'round-robin'), or one given ready-made."""
    if not isinstance(router, str):
        return router
    from .baselines import RoundRobinRouter
    from .policy import SwapAwareRouter
    if router == "swap-aware":
        return SwapAwareRouter(n_groups)
    if router == "round-robin":
        return RoundRobinRouter(n_groups)
    raise ValueError(f"router={router!r}: must be one of {', '.join(ROUTERS)}, or a router object")


def start_cluster(engine_config, model_configs: Sequence[Any], n_groups: int, tp: int = 1, pp: int = 1, *,
                  router: Union[str, Any] = "swap-aware", max_restarts: int = 3, timeout_s: Optional[float] = None,
                  placement=None, keepalive=None):
    """Launch ``n_groups`` groups serving ``model_configs`` and return the started ``ClusterEngine`` (Ray
    must be initialized). ``LaunchError`` when a group fails to start (its engine's error) or the cluster
    cannot hold the groups' placement bundles. ``placement``: the host placement's re-planning state
    (``placement.HostPlacement``; its defaults when not given). ``keepalive``: the front's pings of each group
    (``keepalive.KeepaliveConfig``; when not given, its defaults overridden by ``COMPUTRON_GROUP_KEEPALIVE_S``
    and ``COMPUTRON_GROUP_KEEPALIVE_TIMEOUT_S``)."""
    _ray()
    from .front import ClusterEngine
    from .groups import launch_groups
    from .keepalive import KeepaliveConfig
    keepalive = keepalive if keepalive is not None else KeepaliveConfig.from_env()
    handles, pgs = launch_groups(n_groups, engine_config, model_configs, tp, pp, max_restarts=max_restarts)
    cluster = ClusterEngine(handles, make_router(router, n_groups), model_configs, placement_groups=pgs,
                            shutdown_grace_s=engine_config.shutdown_grace_s + 5, placement=placement,
                            keepalive=keepalive)
    return cluster.start(timeout_s if timeout_s is not None else engine_config.start_timeout_s + 60)
