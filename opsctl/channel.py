"""The client end of the remote agent: assemble the one blob it is, start it over a transport, read its stream.

Every verb and the watch layer talk to the agent through `stream_agent`; nothing else knows the bootstrap.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opsctl.config import HostConfig, RunConfig
from opsctl.remote.base import BOOTSTRAP, WRAPPER_SLOT, remote_sources, splice
from opsctl.transport import Transport, TransportError


class ChannelLost(TransportError):
    """The agent's stream ended without its `bye`: SSH dropped, or the remote python died."""


def agent_source() -> bytes:
    """The one blob the remote python3 runs: agent.py with the wrapper's text put in its WRAPPER_SLOT line and
    opsctl/remote's modules (base, rules) registered at its BUNDLE_SLOT line by a small loader.

    One stream, stdlib only, ASCII (the bootstrap's byte count is its character count): the remote side needs
    nothing installed, and the wrapper the agent writes at launch is the very agent_wrapper.py shipped with it,
    with the same modules spliced in.
    """
    here = Path(__file__).parent  # the agent's files, read as text: the client never imports the agent's verbs
    text = (here / "agent.py").read_text(encoding="ascii")
    wrapper = (here / "agent_wrapper.py").read_text(encoding="ascii")
    slot = "\n" + WRAPPER_SLOT
    if text.count(slot) != 1:
        raise RuntimeError(f"opsctl/agent.py must hold exactly one line {WRAPPER_SLOT!r}")
    text = text.replace(slot, f"\n_SHIPPED_WRAPPER: str | None = {wrapper!r}\n")
    return splice(text, remote_sources()).encode("ascii")


def agent_argv(host: HostConfig, verb: str, args: dict[str, Any]) -> list[str]:
    """`python3 -u -c BOOTSTRAP VERB JSON` as one argv; each transport layer quotes it once."""
    python = host.python if host.is_remote else sys.executable
    return [python, "-u", "-c", BOOTSTRAP, verb, json.dumps(args, separators=(",", ":"))]


def run_args(run: RunConfig, **options: Any) -> dict[str, Any]:
    """The run settings as the agent reads them, plus verb options."""
    data = run.model_dump(mode="json")
    data["command"] = run.argv
    data["options"] = options
    return data


def stream_agent(transport: Transport, host: HostConfig, verb: str, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yield the agent's messages up to and including `bye`; raise ChannelLost if the stream ends first."""
    src = agent_source()
    stream = transport.stream(agent_argv(host, verb, args), str(len(src)).encode() + b"\n" + src)
    got_bye = False
    try:
        for raw in stream.stdout:
            line = raw.strip()
            if not line:
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                msg = {"t": "garbage", "line": line.decode(errors="replace")}
            if not isinstance(msg, dict):
                continue
            yield msg
            if msg.get("t") == "bye":
                got_bye = True
                return
    finally:
        try:
            stream.close()  # EOF on the agent's stdin: it exits at once
        except (TransportError, OSError):
            pass
        if not got_bye:
            try:
                stream.kill()
            except (TransportError, OSError):
                pass
    err = stream.stderr.decode(errors="replace").strip()
    raise ChannelLost(f"the agent's channel closed before it finished{': ' + err[-800:] if err else ''}")
