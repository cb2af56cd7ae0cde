"""``python -m computron serve ...`` (the same as the ``computron`` console script)."""
import sys

from .server.cli import main

if __name__ == "__main__":
    sys.exit(main())
