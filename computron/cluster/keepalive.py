"""The front's keepalive per engine group: a group that stops answering is taken out of routing within
seconds, instead of when Ray's own health checks give its node up (by default about 60 s:
``health_check_period_ms`` x ``health_check_failure_threshold`` of the GCS, see docs/cluster.md).

One ping is outstanding per group at a time: ``keep_alive`` sends it, waits ``timeout_s`` for the answer
(the group's incarnation), and when none came, calls ``on_silent`` and keeps waiting for that same ping: its
answer (the link is back) calls ``on_answer``, its failure (the actor died) is left to the group's push stream,
which tells the front of deaths and restarts. Between two answered pings it waits ``interval_s``. No Ray here:
``ping`` is any coroutine function (the front passes ``group.ping.remote``).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional

log = logging.getLogger("computron.cluster")

ENV_INTERVAL = "COMPUTRON_GROUP_KEEPALIVE_S"
ENV_TIMEOUT = "COMPUTRON_GROUP_KEEPALIVE_TIMEOUT_S"


@dataclass(frozen=True)
class KeepaliveConfig:
    interval_s: float = 1.0
    """Seconds between a group's answer and the next ping; 0 turns the keepalive off."""
    timeout_s: float = 4.0
    """A group that has not answered a ping within this many seconds gets no new request until it answers."""

    def __post_init__(self):
        for name in ("interval_s", "timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"KeepaliveConfig.{name}={v!r}: must be a finite number >= 0")
        if self.interval_s > 0 and self.timeout_s <= 0:
            raise ValueError(f"KeepaliveConfig.timeout_s={self.timeout_s!r}: must be > 0 while the keepalive is on")

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "KeepaliveConfig":
        """The defaults, overridden by ``COMPUTRON_GROUP_KEEPALIVE_S`` (0: off) and
        ``COMPUTRON_GROUP_KEEPALIVE_TIMEOUT_S``."""
        env = os.environ if env is None else env
        kw = {}
        for var, name in ((ENV_INTERVAL, "interval_s"), (ENV_TIMEOUT, "timeout_s")):
            if env.get(var, "").strip():
                try:
                    kw[name] = float(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r}: must be a number of seconds") from None
        return cls(**kw)


async def keep_alive(group: int, ping: Callable[[], Awaitable[Any]], config: KeepaliveConfig,
                     on_silent: Callable[[int, str], None], on_answer: Callable[[int, Any], None],
                     stopped: Callable[[], bool]) -> None:
    """Ping ``group`` until ``stopped()`` (or cancelled); see the module docstring."""
    while not stopped():
        task = asyncio.ensure_future(ping())
        try:
            done, _ = await asyncio.wait({task}, timeout=config.timeout_s)
            if not done:
                on_silent(group, f"no answer to the front's keepalive within {config.timeout_s:g}s "
                                 f"({ENV_TIMEOUT}); its node is cut off, stopped or overloaded")
                await asyncio.wait({task})
            if task.exception() is None:
                on_answer(group, task.result())
        except asyncio.CancelledError:
            task.cancel()
            raise
        await asyncio.sleep(config.interval_s)
