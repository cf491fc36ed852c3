"""`opsctl watch` on a group run: the dashboard says the group's own state next to its nodes' (training only when
every node trains, crashed naming the node that died first), and `watch --once --json` carries it as `group`.

Driven by agent streams written here and replayed (RecordedSource), like tests/test_tui.py; the live two-host
check is in tests/test_group.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_tui import settle, text_of  # the dashboard tests' own helpers

from opsctl.tui import WatchApp, watch_main
from opsctl.watch import GroupTag, RecordedSource, group_infos
from opsctl.widgets import RunsBar, RunSummary

SIZE = (120, 40)


def hello(ts: float) -> dict[str, Any]:
    return {"t": "hello", "ts": ts, "agent_version": "1", "host": "h", "pid": 1, "python": "3", "nvml": "ok"}


def proc(ts: float, state: str = "running", exit_code: int | None = None, exception: str | None = None
         ) -> dict[str, Any]:
    return {"t": "proc", "ts": ts, "state": state, "pid": 7, "pgid": 7, "exit_code": exit_code, "session": "s",
            "exception": exception, "attempt": 1, "started": 1.0, "ended": None if state == "running" else ts}


def event(ts: float, **ev: Any) -> dict[str, Any]:
    return {"t": "event", "ts": ts, "off": 0, "end": 1, "event": {"v": 1, "ts": ts, "run_id": "r", "seq": 0, **ev}}


def node_stream(tmp: Path, name: str, rank: int, crash: str | None = None) -> Path:
    """One node's agent stream: rank 0 starts the run and steps; another node's rank only heartbeats (it never
    sees run_start or phase events); `crash`: the node's torchrun then exits 1 with that exception line."""
    msgs = [hello(1.0), proc(1.0)]
    if rank == 0:
        msgs += [event(2.0, kind="run_start", rank=0, config={}, versions={}, kernels={}, device="cpu",
                       world_size=2, roles={"colocated": [0, 1]}, resumed_from=None, pid=7, host="h",
                       total_steps=100)]
        msgs += [event(2.0 + i, kind="step", rank=0, step=i, epoch=0, loss=1.0 / i, acc=[0.5], lr=1e-3,
                       grad_norm=1.0, tokens=10, tokens_per_s=10.0, step_time_s=1.0, total_steps=100)
                 for i in range(1, 4)]
    else:
        # its first heartbeats from before training: the latest heartbeat's phase is where the node is
        msgs += [event(2.0 + i, kind="heartbeat", rank=rank, step=i, phase="preparing_data" if i == 1 else "training")
                 for i in range(1, 4)]
    if crash:
        msgs += [proc(6.0, "exited", 1, crash)]
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    return path


def sources(tmp: Path, crash1: str | None = None, crash0: str | None = None) -> list[RecordedSource]:
    return [RecordedSource(node_stream(tmp, "n0", 0, crash0), label="n0:pair-r-node0", group=GroupTag("pair", "r", 0, 2)),
            RecordedSource(node_stream(tmp, "n1", 1, crash1), label="n1:pair-r-node1", group=GroupTag("pair", "r", 1, 2)),
            RecordedSource(node_stream(tmp, "solo", 0), label="box:solo")]


def test_group_state_from_its_nodes() -> None:
    tags = [GroupTag("pair", "r", 1, 2), GroupTag("pair", "r", 0, 2), None]
    training = {"state": "training", "proc_state": "running"}
    infos = group_infos(tags, [{"host": "n1", **training}, {"host": "n0", **training}, {"host": "x", **training}])
    assert infos[0] == infos[1] and infos[2] is None
    assert {k: infos[0][k] for k in ("name", "run", "state", "reason", "node", "nodes")} == {  # type: ignore[index]
        "name": "pair", "run": "r", "state": "training", "reason": None, "node": None, "nodes": 2}
    # a node whose ranks only heartbeat (no run_start) and still read `starting` counts by its heartbeat's phase
    info = group_infos(tags[:2], [{"host": "n1", "state": "starting", "proc_state": "running", "phase": "training"},
                                  {"host": "n0", **training}])[0]
    assert info is not None and info["state"] == "training"
    # training only when every node trains: one node still loading holds the group at loading
    info = group_infos(tags[:2], [{"host": "n1", **training}, {"host": "n0", "state": "loading"}])[0]
    assert info is not None and info["state"] == "loading"
    # crashed names the node that died first, not the one whose ranks only lost their peer (even if it ended first)
    info = group_infos(tags[:2], [
        {"host": "n1", "state": "crashed", "reason": "RuntimeError: boom (exit 1)", "started_at": 0.0, "duration_s": 9},
        {"host": "n0", "state": "crashed", "reason": "DistNetworkError: Connection closed by peer (exit 1)",
         "started_at": 0.0, "duration_s": 5}])[0]
    assert info is not None and (info["state"], info["node"]) == ("crashed", 1)
    assert info["reason"] == "node1 n1: RuntimeError: boom (exit 1)"
    info = group_infos(tags[:2], [{"host": "n1", "state": "crashed", "reason": "boom"}, {"host": "n0", **training}])[0]
    assert info is not None and info["reason"] == "node1 n1: boom; still running: node0 n0"


@pytest.mark.anyio
async def test_dashboard_shows_the_group_training_then_crashed_naming_the_node(tmp_path: Path) -> None:
    app = WatchApp(sources(tmp_path), clock=lambda: 6.5)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        bar = text_of(app, RunsBar)
        assert "pair/r  TRAINING  :" in bar, bar  # the group badge, then its nodes
        assert bar.index("pair/r") < bar.index("n0:pair-r-node0") < bar.index("n1:pair-r-node1") < bar.index("box:solo")
        assert bar.count("TRAINING") == 4, bar  # the group, its two nodes, the host run
        summary = text_of(app, RunSummary)
        assert "group pair/r  TRAINING" in summary, summary
        await pilot.press("tab", "tab")  # the host run: no group line
        app.tick()
        assert "group" not in text_of(app, RunSummary)

    app = WatchApp(sources(tmp_path / "..", crash1="RuntimeError: rank 1 boom"), clock=lambda: 6.5)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        bar = text_of(app, RunsBar)
        assert "pair/r  CRASHED (node1)  :" in bar, bar
        assert app.current == 1  # opens on the crashed node
        summary = text_of(app, RunSummary)
        assert "group pair/r  CRASHED (node1)" in summary and "node1 n1: RuntimeError: rank 1 boom" in summary, summary
        assert "still running: node0 n0" in summary  # what status would stop next
        await pilot.press("tab", "tab")  # node 0 says it too: the group is one run
        app.tick()
        assert app.current == 0 and "node1 n1: RuntimeError: rank 1 boom" in text_of(app, RunSummary)


def test_once_json_gives_every_node_the_group_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert watch_main(list(sources(tmp_path, crash1="RuntimeError: rank 1 boom")), plain=False, once_json=True,
                      bell=False) == 0
    snaps = json.loads(capsys.readouterr().out)
    assert [s["run"] for s in snaps] == ["pair-r-node0", "pair-r-node1", "solo"]
    assert "group" not in snaps[2] and snaps[0]["group"] == snaps[1]["group"]
    g = snaps[0]["group"]
    assert (g["name"], g["run"], g["state"], g["node"], g["nodes"]) == ("pair", "r", "crashed", 1, 2), g
    assert g["reason"].startswith("node1 n1: RuntimeError: rank 1 boom"), g
