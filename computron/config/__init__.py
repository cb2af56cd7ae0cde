"""Validated configuration dataclasses (engine, models). A bad field raises ``ValueError`` naming it."""
from .engine import EngineConfig
from .model import ModelConfig, check_model_configs, check_world

__all__ = ["EngineConfig", "ModelConfig", "check_model_configs", "check_world"]
