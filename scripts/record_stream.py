"""Record a live run's agent stream (docs/agent-protocol.md) as JSON lines, for tests/fixtures/streams/.

Follows HOST:RUN from the first byte of its log and events, for at most --seconds, through the same path as
`opsctl watch` (watch.AgentSource); the file replays with `python -m opsctl.tui FILE` or `RecordedSource`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from opsctl.commands import Ctx, watch_sources
from opsctl.watch import AgentSource, record


class UntilExit:
    """Ends the stream once the run's process has exited (the agent's `follow` itself goes on for a relaunch)."""

    def __init__(self, inner: AgentSource) -> None:
        self.inner = inner
        self.label = inner.label

    def messages(self) -> Iterator[dict[str, Any]]:
        for m in self.inner.messages():
            yield m
            if m.get("t") == "proc" and m.get("state") == "exited":
                return

    def kill(self) -> None:
        self.inner.kill()

    def clean(self) -> None:
        self.inner.clean()

    def reconnect(self) -> None:
        self.inner.reconnect()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("host")
    p.add_argument("run")
    p.add_argument("out", help="JSON-lines file to write")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--hosts", default=None, help="inventory file (default ./hosts.yaml)")
    p.add_argument("--until-exit", action="store_true", help="stop when the run's process exits")
    args = p.parse_args(argv)
    (source,) = watch_sources(Ctx(hosts_file=args.hosts), [f"{args.host}:{args.run}"])
    source.offsets = {"log_offset": 0, "events_offset": 0}
    n = record(UntilExit(source) if args.until_exit else source, args.out, max_seconds=args.seconds)
    print(f"recorded {n} messages from {source.label} into {args.out}")
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
