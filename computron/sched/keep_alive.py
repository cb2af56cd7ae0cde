"""How long an idle model stays resident: Ollama's ``keep_alive``, per request and per model (pure policy).

A keep-alive is a number of seconds (``FOREVER``, -1: resident while memory allows, i.e. until another
model needs its room; 0: offloaded as soon as its requests are done). ``parse_keep_alive`` reads what users
write: a duration (``"5m"``, ``"30s"``, ``"1h30m"``, ``"250ms"``), a number of seconds (``300``, ``"300"``),
``0``, or any negative number for ``FOREVER``; anything else is a ``KeepAliveError`` naming the field.

``KeepAlives`` decides, for a model with nothing left to do, until when it stays: the keep-alive of its
latest request if that request gave one (Ollama's rule: each request sets it for the time after it), else
the model's own (``ModelConfig.keep_alive``), else the engine's (``EngineConfig.keep_alive``), counted from
when its last request was answered. ``expired`` names the idle models whose time is up; the engine offloads
them (``Scheduler.release``). Eviction to make room for another model is not its business: a model kept
resident still leaves when the scheduler needs its slot.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Dict, Iterable, List, Optional, Union

FOREVER = -1.0

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_HINT = ("a duration like '5m', '30s' or '1h30m', a number of seconds, 0 (offload once its requests are done) "
         "or -1 (keep resident while memory allows)")


class KeepAliveError(ValueError):
    """A keep-alive value that is not one; the message names the field (``param``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_keep_alive(value: Union[str, int, float], field: str = "keep_alive") -> float:
    """Seconds to keep an idle model resident: ``FOREVER`` for a negative value, else >= 0."""
    def bad() -> KeepAliveError:
        return KeepAliveError(f"{field}={value!r}: must be {_HINT}", field)

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise bad()
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            return _duration(text, bad)
        value = number
    if not math.isfinite(value):
        raise bad()
    return FOREVER if value < 0 else float(value)


def _duration(text: str, bad) -> float:
    """Go's ``time.ParseDuration`` syntax, as Ollama reads ``keep_alive``: ``[-]`` then number+unit pieces."""
    sign, rest = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    if not rest:
        raise bad()
    total = 0.0
    while rest:
        m = _DURATION.match(rest)
        if m is None:
            raise bad()
        total += float(m.group(1)) * _UNITS[m.group(2)]
        rest = rest[m.end():]
    return FOREVER if sign < 0 and total > 0 else total


def describe(seconds: float) -> str:
    """A keep-alive as people read it: ``forever``, ``0s``, ``30s``, ``5m``, ``1h30m``."""
    if seconds < 0:
        return "forever"
    s = int(round(seconds))
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (sec, "s")) if v) or "0s"


class KeepAlives:
    """Each model's keep-alive and when its last request was answered; which idle models' time is up."""

    def __init__(self, default_s: float = FOREVER, own: Callable[[str], Optional[float]] = lambda m: None):
        """``own(m)``: ``m``'s own keep-alive (``ModelConfig.keep_alive``; None: the engine's ``default_s``)."""
        self.default_s = default_s
        self._own = own
        self._requested: Dict[str, float] = {}
        """The keep-alive the latest request of each model gave (none: the model's own applies)."""
        self._last_done: Dict[str, float] = {}

    def requested(self, m: str, seconds: Optional[float]) -> None:
        """A request for ``m`` arrived with this keep-alive (None: it gave none, the model's own applies)."""
        if seconds is None:
            self._requested.pop(m, None)
        else:
            self._requested[m] = seconds

    def done(self, m: str, now: float) -> None:
        """A request of ``m`` was answered (or cancelled) at ``now``."""
        self._last_done[m] = now

    def keep_s(self, m: str) -> float:
        """``m``'s keep-alive now: its latest request's, else its own, else the engine's."""
        if m in self._requested:
            return self._requested[m]
        own = self._own(m)
        return self.default_s if own is None else own

    def last_done(self, m: str) -> Optional[float]:
        return self._last_done.get(m)

    def until(self, m: str) -> Optional[float]:
        """When ``m``, idle, leaves (on the caller's clock); None: it stays (forever, or never used)."""
        keep, last = self.keep_s(m), self._last_done.get(m)
        if keep < 0 or last is None:
            return None
        return last + keep

    def expired(self, idle: Iterable[str], now: float) -> List[str]:
        """The models of ``idle`` (resident, with nothing queued, running or in flight) whose time is up."""
        out = []
        for m in idle:
            t = self.until(m)
            if t is not None and t <= now:
                out.append(m)
        return out

    def remove(self, m: str) -> None:
        for d in (self._requested, self._last_done):
            d.pop(m, None)
