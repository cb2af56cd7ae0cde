"""The master engine: ``Engine`` (core.py) and the components it drives; see core.py's docstring."""
from .core import Engine
from .telemetry import EngineSnapshot, ModelSnapshot

__all__ = ["Engine", "EngineSnapshot", "ModelSnapshot"]
