"""`python -m shardserve ...`: the command line (see shardserve/entrypoints/cli.py)."""

from __future__ import annotations

import sys

from shardserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
