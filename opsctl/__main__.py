"""`python -m opsctl`: the same entry point as the `opsctl` console script.

Kept separate so the agent file and the CLI never import each other's side effects.
"""

import sys

from opsctl.cli import main

sys.exit(main())
