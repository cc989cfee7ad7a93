"""``python -m isrctl``: the `isr` command (`isrctl.cli`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
