"""``computron.zoo_understanding``, the name the README and examples use: the encoder fixtures of
:mod:`computron.testing.zoo_understanding`, plus the loader this module used to hold (now
:mod:`computron.loading`)."""
from .loading import load_encoder
from .testing.zoo_understanding import *  # noqa: F401,F403
from .testing.zoo_understanding import __all__ as _fixtures

__all__ = [*_fixtures, "load_encoder"]
