"""``computron.tokenizer_zoo``, the name the examples use: the tokenizer fixtures of
:mod:`computron.testing.tokenizer_zoo`."""
from .testing.tokenizer_zoo import *  # noqa: F401,F403
from .testing.tokenizer_zoo import __all__  # noqa: F401
