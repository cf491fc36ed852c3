"""Test run that writes its log file itself (logging FileHandler + stdout StreamHandler, like dflash train),
prints a plain stdout line first, then dies with a traceback on stderr.
"""

from __future__ import annotations

import logging
import sys

log_path = sys.argv[1]
print("banner before logging is set up", flush=True)
logger = logging.getLogger("selflog")
logger.setLevel(logging.INFO)
for h in (logging.FileHandler(log_path), logging.StreamHandler(sys.stdout)):
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(h)
for i in range(5):
    logger.info("record %d", i)
    print(f"plain print {i}", flush=True)  # stdout only: must reach the log too
raise RuntimeError("selflog died")
