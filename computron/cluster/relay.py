"""Engine errors carried from a group to the front with their type (``Relayed``)."""
from __future__ import annotations

import importlib
import pickle
from typing import Any, Tuple


class Relayed(Exception):
    """An exception raised in a group, carried to the front by type name, args and attributes, and
    rebuilt there without calling its ``__init__`` (``original``)."""

    def __init__(self, where: Tuple[str, str], args: tuple, state: dict, text: str):
        super().__init__(text)
        self.where, self.exc_args, self.state, self.text = where, args, state, text

    @classmethod
    def of(cls, exc: BaseException) -> "Relayed":
        where = (type(exc).__module__, type(exc).__qualname__)
        args, state = exc.args, dict(getattr(exc, "__dict__", {}))
        try:
            pickle.dumps((args, state))
        except Exception:  # noqa: BLE001 - an unpicklable attribute: keep the message
            args, state = (str(exc),), {}
        return cls(where, args, state, f"{type(exc).__name__}: {exc}")

    def __reduce__(self):
        return type(self), (self.where, self.exc_args, self.state, self.text)

    def original(self) -> BaseException:
        try:
            obj: Any = importlib.import_module(self.where[0])
            for part in self.where[1].split("."):
                obj = getattr(obj, part)
            exc = obj.__new__(obj)
            exc.args = self.exc_args
            exc.__dict__.update(self.state)
            return exc
        except Exception:  # noqa: BLE001 - a type the front cannot import
            return RuntimeError(self.text)
