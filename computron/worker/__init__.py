"""One worker rank: its command loop and heartbeats, shard builds, its host tier, and model and adapter
changes while serving."""
from .. import _lazy_exports

_EXPORTS = {".worker": ("Worker", "is_fatal_transport_error")}

__all__ = [name for names in _EXPORTS.values() for name in names]
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
