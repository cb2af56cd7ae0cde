"""``computron.zoo``, the name the README and examples use: the causal-LM fixtures of
:mod:`computron.testing.zoo`, plus the loaders this module used to hold (now :mod:`computron.loading`)."""
from .loading import checkpoint_dtype, load_causal_lm
from .testing.zoo import *  # noqa: F401,F403
from .testing.zoo import __all__ as _fixtures

__all__ = [*_fixtures, "checkpoint_dtype", "load_causal_lm"]
