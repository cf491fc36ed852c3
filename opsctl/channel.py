"""The client end of the remote agent: assemble the one blob it is, start it over a transport, read its stream.

Every verb and the watch layer talk to the agent through `stream_agent`; nothing else knows the bootstrap.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

from opsctl.config import HostConfig, RunConfig
from opsctl.remote.base import BOOTSTRAP, remote_sources, shipped_script
from opsctl.transport import Transport, TransportError


class ChannelLost(TransportError):
    """The agent's stream ended without its `bye`: SSH dropped, or the remote python died."""


def agent_source() -> bytes:
    """The one blob the remote python3 runs: opsctl/remote's modules (the verbs in remote/agent.py, the wrapper in
    remote/wrapper.py and what they share) registered by a small loader, then the agent's `main` (base.shipped_script).

    One stream, stdlib only, ASCII (the bootstrap's byte count is its character count): the remote side needs
    nothing installed, and the wrapper the agent writes at launch is made of the very modules shipped with it.
    The client reads the modules as text (remote_sources) and never imports the agent's verbs.
    """
    return shipped_script("opsctl.remote.agent", "main(sys.argv[1:])", remote_sources()).encode("ascii")


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
