"""Computron: serve many models on shared GPUs by model-parallel swapping."""
from .batch import BatchManager, SubmitEntry, TaskEntry
from .config import EngineConfig, ModelConfig
from .engine import Engine
from .errors import (ComputronError, EngineDeadError, LaunchError, PayloadError, QueueFullError, RequestError,
                     RequestTimeoutError, UnknownModelError, WorkerError)
from .generation import CausalLMBatchManager, OPTBatchManager
from .launch import LaunchEngine, launch_computron
from .metrics import BatchRecord, RequestRecord, SwapRecord
from .scheduler import ModelState, Scheduler
from .understanding import EmbeddingBatchManager, ImageClassificationBatchManager, TextClassificationBatchManager

__version__ = "0.1.0"

__all__ = [
    "EngineConfig", "ModelConfig", "LaunchEngine", "launch_computron", "Engine", "BatchManager", "SubmitEntry",
    "TaskEntry", "OPTBatchManager", "CausalLMBatchManager", "Scheduler", "ModelState", "SwapRecord",
    "BatchRecord", "RequestRecord", "ComputronError", "RequestError", "UnknownModelError", "PayloadError",
    "QueueFullError", "RequestTimeoutError", "WorkerError", "EngineDeadError", "LaunchError",
    "TextClassificationBatchManager", "EmbeddingBatchManager", "ImageClassificationBatchManager",
]
