"""`computron serve`: an HTTP server in front of the engine, speaking OpenAI's protocol and KServe v2.

``app.py``'s docstring maps the package (routers, state, errors, protocols). The names below are
imported on first use, so ``computron --help`` (``computron.server.cli``) does not pay for FastAPI,
torch or transformers.
"""
from .. import _lazy_exports

_EXPORTS = {".app": ("create_app",), ".config": ("ConfigError", "ServeConfig"),
            "..engine.protocol": ("EngineClient",), ".model_kind": ("ModelKind",),
            ".text": ("ModelText", "IncrementalDetokenizer", "TextStream")}

__all__ = [name for names in _EXPORTS.values() for name in names]
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
