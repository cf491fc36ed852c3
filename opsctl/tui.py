"""`opsctl watch` entry points: the Textual dashboard (opsctl/dashboard.py), `--plain` and `--once --json`.

Textual and plotext are imported only for the dashboard itself: `watch --once --json` and `--plain` start as fast as
`status` (bench/ops_latency.py --only watch). `WatchApp` and the dashboard's constants are still importable from here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from opsctl.group import rankless
from opsctl.remote.base import EXIT_CODES
from opsctl.watch import (  # noqa: F401 (re-exported)
    SCREENSHOT_ENV,
    RecordedSource,
    SourceWorker,
    WatchSource,
    group_infos,
    screenshot_dir,
)


def __getattr__(name: str) -> Any:
    """`from opsctl.tui import WatchApp` (and TICK_S, ...): the dashboard module, imported on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    from opsctl import dashboard

    try:
        return getattr(dashboard, name)
    except AttributeError:
        raise AttributeError(f"module 'opsctl.tui' has no attribute {name!r}") from None


# The dashboard waits at most this long for its sources' SSH handshakes before it loads Textual: a handshake done
# alone (~0.15 s) lets the remote start-up and backlog overlap Textual's import; an unreachable host delays the
# screen (which would say `connecting` meanwhile) by no more than this.
HEAD_START_S = 0.5


def watch_main(sources: list[WatchSource], plain: bool, once_json: bool, bell: bool) -> int:
    """Entry point for `opsctl watch`: the Textual app, `--plain` (rich Live) or `--once --json` (one snapshot)."""
    if not sources:
        raise SystemExit("opsctl watch: no runs to watch (check hosts.yaml or the HOST:RUN arguments)")
    if once_json:
        from opsctl.plain import snapshot_once

        snaps = snapshot_once(sources)
        tags = [getattr(s, "group", None) for s in sources]
        for snap, tag in zip(snaps, tags, strict=True):
            if tag is not None and tag.node > 0 and snap["state"] == "starting" and snap.get("proc_state") == "running":
                snap["state"] = rankless({**snap, "node": tag.node})["state"]
        for snap, info in zip(snaps, group_infos(tags, snaps), strict=True):
            if info is not None:  # a node of a group run: the group's own state, as `status --json` says it
                snap["group"] = info
        print(json.dumps(snaps, indent=2, default=str))
        # As `opsctl status`: 0 when every host answered, 3 (transport) when one could not be reached.
        return EXIT_CODES["ok"] if all(s["link"] == "up" for s in snaps) else EXIT_CODES["transport"]
    if plain:
        from opsctl.plain import run_plain

        return run_plain(sources, bell=bell)
    # Connect first, then load Textual: the SSH handshake, the agent's start and its backlog (most of a week-long
    # run's first frame) go on while Textual imports and builds the screen (bench/ops_latency.py --only long-ssh).
    followers = [SourceWorker(s).start() for s in sources]
    deadline = time.monotonic() + HEAD_START_S
    for s in sources:  # each agent's command sent (or its connect failed), for at most HEAD_START_S in all
        asked = getattr(s, "asked", None)
        if asked is not None:
            asked.wait(max(0.0, deadline - time.monotonic()))
    try:
        from opsctl.dashboard import WatchApp

        app = WatchApp(sources, bell=bell, followers=followers)
    except BaseException:
        for w in followers:
            w.stop()
        raise
    result = app.run()
    return int(result or 0)


def replay_main(argv: list[str] | None = None) -> int:
    """`python -m opsctl.tui [--speed X] [--plain | --once-json] FILE...`: the dashboard over recorded streams (demos)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m opsctl.tui", description=replay_main.__doc__)
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="recorded agent stream (JSON lines)")
    p.add_argument("--speed", type=float, default=None, help="replay at X times real time (default: at once)")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--once-json", action="store_true")
    p.add_argument("--bell", action="store_true")
    args = p.parse_args(argv)
    try:
        sources: list[WatchSource] = [RecordedSource(f, label=f"replay:{f.stem}", speed=args.speed) for f in args.files]
    except (FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    return watch_main(sources, plain=args.plain, once_json=args.once_json, bell=args.bell)


if __name__ == "__main__":
    raise SystemExit(replay_main())
