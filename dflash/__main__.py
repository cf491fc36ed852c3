"""`python -m dflash ...`: the same CLI as the `dflash` console script (what `opsctl launch local tiny` runs).

Kept separate from cli.py so `-m` works without an installed entry point.
"""

from __future__ import annotations

import sys

from dflash.cli import main

if __name__ == "__main__":
    sys.exit(main())
