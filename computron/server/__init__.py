"""`computron serve`: an OpenAI-compatible HTTP server in front of the engine (text in, text out)."""
from .app import create_app
from .config import ConfigError, ServeConfig
from .text import IncrementalDetokenizer, ModelText, TextStream

__all__ = ["create_app", "ConfigError", "ServeConfig", "ModelText", "IncrementalDetokenizer", "TextStream"]
