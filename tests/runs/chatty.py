"""Test run that writes numbered log lines (optionally with its send time) so tests can check loss and order.
"""

from __future__ import annotations

import argparse
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--lines", type=int, default=1000)
p.add_argument("--interval", type=float, default=0.0)
p.add_argument("--start-delay", type=float, default=0.0)
p.add_argument("--linger", type=float, default=0.0, help="seconds to stay alive after the last line")
a = p.parse_args()
time.sleep(a.start_delay)
for i in range(a.lines):
    sys.stdout.write(f"line {i:06d} t={time.time():.6f}\n")
    sys.stdout.flush()
    if a.interval:
        time.sleep(a.interval)
time.sleep(a.linger)
