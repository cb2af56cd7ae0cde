"""Many engine groups: the router that picks a group per request and the planner of host-memory placement.

``policy.py`` (``GroupState``, ``SwapAwareRouter``, ``NoGroupError``), ``baselines.py`` (``RoundRobinRouter``,
``RayMuxRouter``, ``StaticRouter``) and ``planner.py`` (``plan``) are pure policy: no torch, no Ray, no
processes. The Ray mechanism (group actors, the front that calls a router) lives in modules of its own, which
this package does not import, so that ``import computron.cluster`` stays cheap.
"""
from computron.cluster.baselines import RayMuxRouter, RoundRobinRouter, StaticRouter
from computron.cluster.planner import plan
from computron.cluster.policy import GroupState, NoGroupError, Router, SwapAwareRouter

__all__ = ["GroupState", "NoGroupError", "Router", "SwapAwareRouter", "RoundRobinRouter", "RayMuxRouter",
           "StaticRouter", "plan"]
