"""Computron: serve many models on shared GPUs by model-parallel swapping.

The public names below are imported on first use (``from computron import LaunchEngine`` works as
usual), so importing ``computron`` or running ``computron --help`` does not import torch.
"""
import importlib
from typing import Callable, Dict, Tuple

__version__ = "0.1.0"

_EXPORTS = {
    ".batching.base": ("BatchManager", "SubmitEntry", "TaskEntry"),
    ".config": ("EngineConfig", "ModelConfig"),
    ".engine": ("Engine",),
    ".errors": ("ComputronError", "RequestError", "UnknownModelError", "PayloadError", "QueueFullError",
                "RequestTimeoutError", "WorkerError", "EngineDeadError", "LaunchError", "ModelConflictError",
                "ModelChangeError"),
    ".batching.causal_lm": ("CausalLMBatchManager", "OPTBatchManager"),
    ".runtime.launch": ("LaunchEngine", "launch_computron"),
    ".metrics": ("BatchRecord", "RequestRecord", "SwapRecord"),
    ".sched.scheduler": ("ModelState", "Scheduler"),
    ".batching.images": ("ImageClassificationBatchManager",),
    ".batching.text": ("TextClassificationBatchManager", "EmbeddingBatchManager"),
}


def _lazy_exports(package: str, exports: Dict[str, Tuple[str, ...]]) -> Tuple[Callable, Callable]:
    """A package's module-level ``__getattr__`` and ``__dir__`` that import each of ``exports``' names
    (``{".submodule": (name, ...)}``) from its submodule on first use, then keep it as a global."""
    where = {name: mod for mod, names in exports.items() for name in names}
    module = importlib.import_module(package)

    def __getattr__(name):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(module, name, value)
        return value

    def __dir__():
        return sorted(set(vars(module)) | set(where))
    return __getattr__, __dir__


__all__ = [name for names in _EXPORTS.values() for name in names]
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
