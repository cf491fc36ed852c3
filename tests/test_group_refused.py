"""A group run whose node refused to start (run_end `refused`, e.g. a resume it cannot make) is `refused` everywhere:
its supervisor never restarts it (a refusal needs a person, as the single-host wrapper never restarts one), status
stops what the group still runs, history names the refusing node and its words; pure mappings for the badges.

Real sshd on 127.0.0.2 / 127.0.0.3 with their `pct` containers and real torchrun (tests/test_group.py's fixture);
the ranks are a stand-in script that writes the training core's events (docs/events.md) and exits as it would.
"""

from __future__ import annotations

import time
from pathlib import Path

from test_group import (  # the agentlib helper `opsctl` comes along: test_group puts tests/runs on sys.path
    Node,
    group_history,
    group_status,
    nodes,  # noqa: F401 - the module's two-host fixture
    opsctl,
    write_hosts,
)

from opsctl import commands
from opsctl.look import STATE_STYLES
from opsctl.widgets import _group_style, group_badge

# Rank 1 refuses as dflash does when it cannot resume: a fatal error event, run_end `refused`, exit 2; at once (mode
# `always`) or once the file `boom` exists, after stepping (mode `boom`). Rank 0 steps and runs until stopped.
REFUSE_SCRIPT = """
import json, os, sys, time
rank, mode = int(os.environ["RANK"]), sys.argv[2]
def ev(**e):
    with open(sys.argv[1], "a") as fh:
        fh.write(json.dumps({"ts": time.time(), "rank": rank, **e}) + "\\n")
if not (rank == 1 and mode == "always"):
    ev(kind="heartbeat", step=1, phase="training")
    print(f"rank {rank} stepping", flush=True)
while rank == 1 and mode == "boom" and not os.path.exists("boom"):
    time.sleep(0.1)
if rank == 1:
    ev(kind="error", fatal=True, **{"class": "ResumeRefused"}, message="refusing to resume: out/ckpt: size 10 != 20")
    ev(kind="run_end", reason="refused", step=0, exit_code=2)
    print("dflash: refusing to resume: out/ckpt: size 10 != 20", flush=True)
    raise SystemExit(2)
while True:
    time.sleep(0.2)
"""

WHY = "refusing to resume: out/ckpt: size 10 != 20"


def refuse_hosts(tmp: Path, nodes: list[Node], mode: str) -> Path:  # noqa: F811
    (tmp / "ranks.py").write_text(REFUSE_SCRIPT)
    return write_hosts(tmp, nodes, {}, command=["ranks.py", "out/node{node}/events.jsonl", mode],
                       events="out/node{node}/events.jsonl", kill_grace=[5, 2],
                       preflight=["mkdir", "-p", str(tmp / "out/node{node}")],
                       restart={"when": "on-failure", "max": 2, "backoff_s": 0.5, "resume_args": ["--resume"]})


def test_a_supervised_group_whose_node_refuses_is_never_restarted_and_reads_refused(
        tmp_path: Path, nodes: list[Node]) -> None:  # noqa: F811
    hosts = refuse_hosts(tmp_path, nodes, "always")
    r = opsctl(hosts, "launch", "pair", "r", "--follow", timeout=120)
    err = " ".join(r.stderr.split())
    assert r.returncode == commands.EXIT_FAILED, r.stderr[-3000:]
    assert f"pair/r refused: node1 n1 refused to start: {WHY}" in err, err
    assert "pair/r: not restarted: a node refused to start; a refusal needs a person" in err, err
    assert "restarting" not in err and "restart 1 of 2" not in err, err
    h = group_history(hosts)
    assert [(a["id"], a["outcome"], a["node"]) for a in h] == [(1, "refused", 1)], h  # one attempt: no restart
    assert h[0]["reason"].startswith(f"node1 n1: {WHY}"), h
    assert [(x["node"], x["outcome"]) for x in h[0]["nodes"]] == [(0, "stopped"), (1, "refused")], h
    rows = group_status(hosts)  # exit 0: every host answered (group_status asserts it)
    info = rows[0]["group"]
    assert (info["state"], info["node"]) == ("refused", 1), info
    assert info["reason"].startswith(f"node1 n1: {WHY}") and "not restarted: a node refused" in info["reason"], info
    r = opsctl(hosts, "history", "pair", "r")
    assert r.returncode == 0 and f"refused (node1 n1: {WHY}" in " ".join(r.stdout.split()), r.stdout
    assert nodes[0].training() == [] and [p for p, c in nodes[0].procs() if "ranks.py" in c] == []


def test_status_of_an_unfollowed_group_with_a_refused_node_stops_the_rest_and_history_says_refused(
        tmp_path: Path, nodes: list[Node]) -> None:  # noqa: F811
    hosts = refuse_hosts(tmp_path, nodes, "boom")
    r = opsctl(hosts, "launch", "pair", "r", timeout=120)  # returns at READY: nobody follows it
    assert r.returncode == 0 and "READY r: every rank of 2 nodes stepped" in r.stderr, r.stderr
    (tmp_path / "boom").write_text("")  # node 1 refuses
    deadline = time.monotonic() + 60
    while not (proc := opsctl(hosts, "status", "pair", "r")).stderr and time.monotonic() < deadline:
        time.sleep(0.5)  # until status finds the refusal (it says on stderr what it stops)
    assert proc.returncode == commands.EXIT_OK, proc.stderr
    assert f"pair/r refused (node1 n1: {WHY}" in proc.stderr and "stopping node0 n0" in proc.stderr, proc.stderr
    assert [p for p, c in nodes[0].procs() if "ranks.py" in c] == []
    rows = group_status(hosts)
    assert [x["state"] for x in rows] == ["killed", "refused"], rows
    assert (rows[0]["group"]["state"], rows[0]["group"]["node"]) == ("refused", 1), rows[0]["group"]
    (h,) = group_history(hosts)
    assert (h["outcome"], h["node"]) == ("refused", 1) and h["reason"].startswith(f"node1 n1: {WHY}"), h
    assert [(x["node"], x["outcome"]) for x in h["nodes"]] == [(0, "stopped"), (1, "refused")], h


def test_a_refused_groups_badge_names_the_node_in_the_refused_colour_and_its_reason_reads_red() -> None:
    info = {"state": "refused", "node": 1, "reason": f"node1 n1: {WHY}"}
    badge = group_badge(info)
    assert badge.plain == " REFUSED (node1) " and str(badge.style) == STATE_STYLES["refused"]
    assert _group_style(info) == "bold red" == _group_style({"state": "crashed"})
    assert group_badge({"state": "training", "node": None}).plain == " TRAINING "


def test_watch_once_json_group_object_of_a_refused_node_is_refused_naming_it() -> None:
    from opsctl.watch import GroupTag, group_infos

    tags = [GroupTag("pair", "r", 0, 2), GroupTag("pair", "r", 1, 2)]
    info = group_infos(tags, [{"host": "n0", "state": "training", "proc_state": "running"},
                              {"host": "n1", "state": "refused", "reason": f"{WHY} (exit 2)"}])[0]
    assert info is not None and (info["state"], info["node"]) == ("refused", 1), info
    assert info["reason"] == f"node1 n1: {WHY} (exit 2); still running: node0 n0", info


def test_a_single_runs_refusal_reads_red_like_a_crash_and_a_restart_yellow() -> None:
    from opsctl.widgets import reason_style

    assert reason_style("refused") == reason_style("crashed") == reason_style("unreachable") == "bold red"
    assert reason_style("restarting") == reason_style("finished") == "yellow"
