"""`opsctl export GROUP RUN --tensorboard DIR`: node 0's training scalars and every node's ranks under node{N}/.

One tiny group run over the two real sshd "hosts" of tests/test_group.py, read back with TensorBoard's own reader.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_group import (  # the agentlib helper `opsctl` comes along: test_group puts tests/runs on sys.path
    REPO,
    VMID,
    Node,
    losses,
    nodes,  # noqa: F401 - the module's two-host fixture
    opsctl,
    write_hosts,
)

from opsctl.export import STATE_FILE, TensorBoardExport

STEPS = 200  # about 10 s of training on two cores: --follow has steps left to follow


def _tags(logdir: Path) -> list[str]:
    return list(EventAccumulator(str(logdir)).Reload().Tags()["scalars"])


def _scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _heartbeats(events: Path) -> dict[int, int]:
    """Per rank, how many of its heartbeats the file holds (each one a scalar of rank{R}/rss_mb)."""
    out: dict[int, int] = {}
    for e in map(json.loads, events.read_text().splitlines()):
        if e["kind"] == "heartbeat":
            out[e["rank"]] = out.get(e["rank"], 0) + 1
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, nodes: list[Node]) -> Iterator[dict[str, Any]]:  # noqa: F811
    """The group run pair/r (colocated, world 2), launched, then exported with --follow until it ended: (exit code,
    stderr). The inventory also has a host run n0/solo, for the state-file checks: its events file is a copy of node
    0's, made by the test that exports it (hosts.yaml refuses two runs of one host writing one events file)."""
    tmp = tmp_path_factory.mktemp("gexport")
    hosts = write_hosts(tmp, nodes, {"train": {"max_steps": STEPS, "checkpoint_every": 0, "log_every": 1,
                                               "heartbeat_s": 0.2}})
    doc = yaml.safe_load(hosts.read_text())
    doc["hosts"]["n0"]["runs"] = {"solo": {"workdir": str(tmp), "command": ["true"], "log": "solo.log",
                                           "events": "solo-events.jsonl", "clean_roots": [str(tmp)],
                                           "inductor_cache_dir": str(tmp / "solo-cache")}}
    hosts.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        r = opsctl(hosts, "launch", "pair", "r", timeout=240)  # returns at READY: every rank stepped
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        # Every rank paused (SIGSTOP) until the export is following: the backlog cannot hold every step, so the
        # rest only comes through --follow, from both nodes at once.
        ranks = [[str(p) for p, c in n.training() if "dflash.torchrun" not in c and "opsctl-agent" not in c]
                 for n in nodes]
        assert all(ranks), ranks
        signal_ranks(nodes, ranks, "-STOP")
        try:
            cmd = [sys.executable, "-m", "opsctl", "--hosts", str(hosts), "export", "pair", "r", "--tensorboard",
                   str(tmp / "tb"), "--follow"]
            env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
            with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) as proc:
                assert proc.stderr is not None
                seen: list[str] = []
                for line in proc.stderr:
                    seen.append(line)
                    if "steps so far; following" in line:
                        break
                signal_ranks(nodes, ranks, "-CONT")
                seen.append(proc.stderr.read())
                proc.wait(timeout=240)
        finally:  # never leave them stopped (a no-op once they ran on; they may have ended)
            signal_ranks(nodes, ranks, "-CONT", check=False)
        yield {"tmp": tmp, "hosts": hosts, "follow": (proc.returncode, "".join(seen)), "tb": tmp / "tb"}
    finally:
        opsctl(hosts, "kill", "pair", "r", timeout=120)


def signal_ranks(of: list[Node], ranks: list[list[str]], sig: str, check: bool = True) -> None:
    """kill SIG to each node's ranks, by their pids, inside its container."""
    for n, pids in zip(of, ranks, strict=True):
        n.pct.pct("exec", str(VMID), "--", "kill", sig, *pids, check=check)


def test_follow_writes_node0_steps_and_every_nodes_ranks_without_collision(run: dict[str, Any]) -> None:
    (rc, err), tb, tmp = run["follow"], run["tb"], run["tmp"]
    assert rc == 0, err
    before = int(err.split(" steps so far; following group pair/r (2 nodes)")[0].split()[-1])
    assert 1 <= before < STEPS and f"exported group pair/r: {STEPS} steps" in err, err
    node0 = losses(tmp / "out/node0/events.jsonl")
    assert len(node0) == STEPS  # the run ended: --follow followed both nodes to the end
    loss = _scalars(tb, "train/loss")
    assert [s for s, _ in loss] == list(range(1, STEPS + 1))
    assert [v for _, v in loss] == pytest.approx(node0)  # float32 in the event file
    tags = _tags(tb)
    # every heartbeat of every rank, each node's under its own prefix; no bare rank{R}/ tag of the host export
    for n in (0, 1):
        for rank, count in _heartbeats(tmp / f"out/node{n}/events.jsonl").items():
            assert rank == n  # one rank per node, its global rank
            assert len(_scalars(tb, f"node{n}/rank{rank}/rss_mb")) == count
    assert not [t for t in tags if t.startswith(("rank", "gpu"))], tags
    assert {t.split("/")[0] for t in tags} >= {"train", "acc", "perf", "node0", "node1"}, tags
    state = json.loads((tb / STATE_FILE).read_text())
    assert (state["group"], state["run"], state["last_step"]) == ("pair", "r", STEPS)
    assert state["nodes"] == {str(n): {"host": f"n{n}", "events_offset": (tmp / f"out/node{n}/events.jsonl").stat().st_size}
                              for n in (0, 1)}


def test_a_second_export_adds_nothing_and_a_fresh_one_writes_the_same(run: dict[str, Any]) -> None:
    tb, hosts = run["tb"], run["hosts"]
    before = {t: _scalars(tb, t) for t in _tags(tb)}
    r = opsctl(hosts, "export", "pair", "r", "--tensorboard", str(tb))
    assert r.returncode == 0 and "nothing new to export from group pair/r" in r.stderr, r.stderr
    assert {t: _scalars(tb, t) for t in _tags(tb)} == before
    # without --follow, into a new directory: what exists, read from both nodes, the same scalars
    fresh = run["tmp"] / "tb-fresh"
    r = opsctl(hosts, "export", "pair", "r", "--tensorboard", str(fresh))
    assert r.returncode == 0 and f"exported group pair/r: {STEPS} steps" in r.stderr, r.stderr
    assert {t: _scalars(fresh, t) for t in _tags(fresh)} == before


def test_a_directory_of_another_runs_export_is_refused(run: dict[str, Any]) -> None:
    tb, hosts, tmp = run["tb"], run["hosts"], run["tmp"]
    shutil.copyfile(tmp / "out" / "node0" / "events.jsonl", tmp / "solo-events.jsonl")
    state = (tb / STATE_FILE).read_text()
    r = opsctl(hosts, "export", "n0", "solo", "--tensorboard", str(tb))
    assert r.returncode == 2 and "holds the export of group pair/r, not n0:solo" in r.stderr, r.stderr
    assert (tb / STATE_FILE).read_text() == state
    solo = tmp / "tb-solo"
    r = opsctl(hosts, "export", "n0", "solo", "--tensorboard", str(solo))  # a host run: the tags of a host export
    assert r.returncode == 0 and f"{STEPS} steps" in r.stderr, r.stderr
    assert "rank0/rss_mb" in _tags(solo) and not [t for t in _tags(solo) if t.startswith("node")]
    r = opsctl(hosts, "export", "pair", "r", "--tensorboard", str(solo))
    assert r.returncode == 2 and "holds the export of n0:solo, not group pair/r" in r.stderr, r.stderr
    # a state file whose node has another host: the group's members changed since that export
    moved = json.loads(state)
    moved["nodes"]["1"]["host"] = "n9"
    other = tmp / "tb-moved"
    other.mkdir()
    (other / STATE_FILE).write_text(json.dumps(moved))
    r = opsctl(hosts, "export", "pair", "r", "--tensorboard", str(other))
    assert r.returncode == 2 and "node 1 of group pair/r was exported from n9, now it is n1" in r.stderr, r.stderr


def test_gpu_samples_of_a_node_get_its_prefix(tmp_path: Path) -> None:
    tb = TensorBoardExport(tmp_path)
    tb.event({"kind": "step", "ts": 10.0, "step": 3, "loss": 1.0})
    sample = {"t": "gpu", "ts": 11.0, "gpus": [{"index": 0, "util": 90, "mem_used_mb": 5}]}
    tb.gpu_sample(sample, prefix="node0/")
    tb.gpu_sample({**sample, "gpus": [{"index": 0, "util": 40, "mem_used_mb": 7}]}, prefix="node1/")
    tb.event({"kind": "step", "ts": 12.0, "step": 4, "loss": 9.0}, prefix="node1/", run_level=False)  # not rank 0's
    tb.close()
    assert _scalars(tmp_path, "node0/gpu0/util_pct") == [(3, 90.0)]
    assert _scalars(tmp_path, "node1/gpu0/util_pct") == [(3, 40.0)]  # node 0's step, GPU 0 of each node apart
    assert _scalars(tmp_path, "train/loss") == [(3, 1.0)]
