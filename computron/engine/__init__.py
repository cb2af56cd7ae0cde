"""The master's state machine (requests in, decisions out as commands, replies put into effect) and its
``EngineClient`` contract (``protocol.py``); ``core.py``'s docstring maps the components.

The names below are imported on first use: ``computron.engine.protocol`` (the contract the server and
the cluster share) is read without importing torch and the engine's mechanism.
"""
from .. import _lazy_exports

_EXPORTS = {".core": ("Engine",), ".protocol": ("EngineClient", "EngineSnapshot", "ModelSnapshot")}

__all__ = [name for names in _EXPORTS.values() for name in names]
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
