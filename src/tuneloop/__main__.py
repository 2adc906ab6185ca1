"""`python -m tuneloop`: the command line (cli.py)."""

import sys

from tuneloop.cli import main

if __name__ == "__main__":  # (a spawned worker process imports this module without running the command)
    sys.exit(main())
