"""``python -m computron serve ...`` (the same as the ``computron`` console script)."""
import sys

from .server.cli import console

if __name__ == "__main__":
    sys.exit(console())
