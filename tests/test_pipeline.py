"""Tests of the buffer pipeline: reservoir and feed invariants, the split worklists, and split == colocated losses.

The split test runs two real processes (gloo): rank 0 trains the drafter, rank 1 runs the target and sends buffers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from dflash_fixtures import run_config, tiny_run_yaml

from dflash.config import DistConfig
from dflash.pipeline import (
    Feeder,
    Reservoir,
    drafter_feed,
    refeed,
    resolve_roles,
    target_worklist,
    total_steps_for,
)
from dflash.train import train


def test_reservoir_never_drops_or_duplicates_random_ops() -> None:
    for trial in range(200):
        rng = random.Random(trial)
        cap = rng.randint(1, 6)
        res = Reservoir(cap, seed=trial)
        put, taken = [], []
        for i in range(rng.randint(0, 60)):
            if res.full() or (len(res) and rng.random() < 0.5):
                taken.append(res.take()[0])
            else:
                key = (0, i)
                res.put(key, f"payload{i}")
                put.append(key)
        while len(res):
            taken.append(res.take()[0])
        assert Counter(taken) == Counter(put) and len(set(taken)) == len(taken)
    full = Reservoir(1, 0)
    full.put((0, 0), None)
    with pytest.raises(RuntimeError, match="full"):
        full.put((0, 1), None)
    with pytest.raises(RuntimeError, match="empty"):
        Reservoir(2, 0).take()


def _drain(feeder: Feeder, n: int) -> list[tuple[int, int]]:
    return [feeder.next()[0] for _ in range(n)]


@pytest.mark.parametrize(("capacity", "length", "cut"), [(1, 10, 4), (3, 17, 0), (4, 17, 9), (5, 23, 22), (8, 5, 2)])
def test_feeder_consumes_every_key_once_mixes_and_resumes_exactly(capacity: int, length: int, cut: int) -> None:
    keys = [(i // 7, i % 7) for i in range(length)]
    made: list[tuple[int, int]] = []

    def source(_j: int, key: tuple[int, int]) -> tuple[int, int]:
        made.append(key)
        return key

    full = Feeder(keys, capacity, 11, source)
    order = _drain(full, length)
    assert sorted(order) == sorted(keys) and len(set(order)) == length  # no drop, no duplicate, drains the tail
    assert len(made) == length
    if capacity > 2 and length > 10:
        assert order != keys  # mixed, not FIFO
    # stop after `cut` steps, save the state, resume in a fresh feeder: the same order follows
    first = Feeder(keys, capacity, 11, source)
    head = _drain(first, cut)
    state = first.state()
    assert refeed(keys, state)[: len(state.reservoir)] == state.reservoir
    again = Feeder(keys, capacity, 11, source, state)
    tail = _drain(again, length - cut)
    assert head + tail == order


def test_feeds_deal_the_global_stream_round_robin() -> None:
    bpe = [5, 5, 5]
    f0, f1 = (drafter_feed(bpe, 6, 2, d) for d in (0, 1))
    assert f0 == [(0, 0), (0, 2), (0, 4), (1, 1), (1, 3), (2, 0)]
    assert f1 == [(0, 1), (0, 3), (1, 0), (1, 2), (1, 4), (2, 1)]
    assert total_steps_for(5, 3, None, 2) == 7 and total_steps_for(5, 3, 4, 2) == 4
    with pytest.raises(ValueError, match="fewer than"):
        drafter_feed([3], 4, 1, 0)


def test_target_worklists_partition_items_in_global_order() -> None:
    refeeds = [[(0, i) for i in range(7)], [(1, i) for i in range(6)], [(2, i) for i in range(7)]]
    lists = [target_worklist(refeeds, 2, t) for t in range(2)]
    items = [it for lst in lists for it in lst]
    assert sorted((d, k) for _, d, k in items) == sorted((d, k) for d, r in enumerate(refeeds) for k in r)
    for lst in lists:
        seqs = [s for s, _, _ in lst]
        assert seqs == sorted(seqs)  # increasing: with drafters also receiving in seq order, no cycle can form
    for d, r in enumerate(refeeds):  # a drafter sees its own keys in its own order
        assert [k for _, dd, k in sorted(items) if dd == d] == r


def test_roles_from_torchrun_env() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}
    r = resolve_roles(DistConfig(roles="split", target_ranks=2), env)
    assert (r.role, r.drafters, r.targets) == ("target", [0, 1], [2, 3])
    assert r.as_event() == {"drafter": [0, 1], "target": [2, 3]}
    assert resolve_roles(DistConfig(), {}).as_event() == {"colocated": [0]}
    with pytest.raises(ValueError, match="at least"):
        resolve_roles(DistConfig(roles="split", target_ranks=1), {"WORLD_SIZE": "1"})


def test_roles_across_nodes_split_each_node_and_route_only_inside_it() -> None:
    env = lambda r: {"RANK": str(r), "WORLD_SIZE": "8", "LOCAL_RANK": str(r % 4), "LOCAL_WORLD_SIZE": "4"}  # noqa: E731
    r = resolve_roles(DistConfig(roles="split"), env(0))  # balanced per node: 2 of 4 at 1.65 s : 1.17 s
    assert (r.drafters, r.targets, r.lanes) == ([0, 1, 4, 5], [2, 3, 6, 7], [([0, 1], [2, 3]), ([4, 5], [6, 7])])
    r = resolve_roles(DistConfig(roles="split", target_ranks_per_node=1), env(5))
    assert (r.role, r.drafters, r.targets) == ("drafter", [0, 1, 2, 4, 5, 6], [3, 7])
    # Every item of a drafter is computed on its own node, by the target ranks of that node in turn.
    for d in r.drafters:
        assert {r.target_for(j, d) for j in range(6)} == ({3} if d < 4 else {7})
    # The target side agrees: each target's worklist over its lane holds exactly what the drafters will ask it for.
    r8 = resolve_roles(DistConfig(roles="split", target_ranks_per_node=2), env(0))
    refeeds = [[(d, i) for i in range(5)] for d in range(len(r8.drafters))]
    for ds, ts in r8.lanes or []:
        lane_refeeds = [refeeds[r8.drafters.index(x)] for x in ds]
        for t in ts:
            served = {(ds[d], k) for _, d, k in target_worklist(lane_refeeds, len(ts), ts.index(t))}
            asked = {(x, refeeds[r8.drafters.index(x)][j]) for x in ds for j in range(5) if r8.target_for(j, x) == t}
            assert served == asked and served
    # target_ranks keeps the global layout (target ranks at the end of the job), one lane.
    g = resolve_roles(DistConfig(roles="split", target_ranks=2), env(0))
    assert (g.drafters, g.targets, g.lanes) == ([0, 1, 2, 3, 4, 5], [6, 7], None)
    with pytest.raises(ValueError, match="not both"):
        resolve_roles(DistConfig(roles="split", target_ranks=2, target_ranks_per_node=1), env(0))
    with pytest.raises(ValueError, match="leaves no drafter rank"):
        resolve_roles(DistConfig(roles="split", target_ranks_per_node=4), env(0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _split_worker(rank: int, world: int, port: int, out: str, result: str, sections: dict,
                  sigterm_at: int = 0, resume: bool = False) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)

    def on_step(step: int, _loss: float) -> None:
        if step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)

    import dflash.target

    built = []  # Target instances this rank constructs (the held-out set must not add one: issue 39)
    init = dflash.target.Target.__init__

    def counting_init(self: dflash.target.Target, *a: object, **k: object) -> None:
        built.append(1)
        init(self, *a, **k)

    dflash.target.Target.__init__ = counting_init  # type: ignore[method-assign]
    res = train(run_config(**sections), out, resume=resume, on_step=on_step if sigterm_at else None)
    Path(f"{result}.{rank}").write_text(json.dumps({"losses": res.losses, "code": res.exit_code,
                                                    "reason": res.reason, "targets_built": len(built)}))
    os._exit(0)  # as `dflash train` leaves a multi-rank run: torch's process-group destructors can deadlock at exit


def test_split_target_and_drafter_ranks_give_colocated_losses(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    sections = {"train": {"max_steps": 8, "checkpoint_every": 0, "eval_every": 4}}
    split = {**sections, "dist": {"roles": "split", "target_ranks": 1}}
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache-split"))  # the held-out set is made, not found
    mp.start_processes(_split_worker, args=(2, _free_port(), str(tmp_path / "split"), str(tmp_path / "r"), split),
                       nprocs=2, join=True, start_method="spawn")
    drafter = json.loads((tmp_path / "r.0").read_text())
    target = json.loads((tmp_path / "r.1").read_text())
    assert drafter["code"] == 0 and target["code"] == 0 and len(drafter["losses"]) == 8
    # The held-out set was made by the target rank's training target: the drafter rank never loads a target.
    assert (drafter["targets_built"], target["targets_built"]) == (0, 1)
    assert "eval: made the held-out set for drafter rank 0" in (tmp_path / "split" / "train.rank1.log").read_text()
    assert len(list((tmp_path / "cache-split").glob("heldout-*/taps.pt"))) == 1
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache-colocated"))  # made again, locally: the same set
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float reduction order as the workers
    try:
        colocated = train(run_config(**sections), tmp_path / "colocated")
    finally:
        torch.set_num_threads(threads)
    assert drafter["losses"] == colocated.losses
    events = [json.loads(x) for x in (tmp_path / "split" / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["kind"] == "run_start")
    assert start["roles"] == {"drafter": [0], "target": [1]} and start["world_size"] == 2
    assert {e["rank"] for e in events} <= {0, 1}
    assert all(e["rank"] == 0 for e in events if e["kind"] not in ("heartbeat", "error"))
    # The drafter rank measures tau without a target (the held-out set carries the target's taps): the same figures.
    def evals(path: Path) -> list[dict]:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return [{k: v for k, v in e.items() if k not in ("ts", "seq", "run_id", "seconds")} for e in rows
                if e["kind"] == "eval"]

    assert [e["step"] for e in evals(tmp_path / "split" / "events.jsonl")] == [4, 8]
    assert evals(tmp_path / "split" / "events.jsonl") == evals(tmp_path / "colocated" / "events.jsonl")


def test_split_sigterm_stops_both_roles_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGTERM on the drafter: it tells the target rank to stop, both exit 0; the resumed split run continues the
    same loss sequence as an uninterrupted split run would (checked against colocated, proven equal above)."""
    sections = {"train": {"max_steps": 8, "checkpoint_every": 0}, "dist": {"roles": "split", "target_ranks": 1}}
    out = str(tmp_path / "split")
    for part, kwargs in (("a", {"sigterm_at": 3}), ("b", {"resume": True})):
        mp.start_processes(_split_worker, args=(2, _free_port(), out, str(tmp_path / part), sections,
                                                kwargs.get("sigterm_at", 0), kwargs.get("resume", False)),
                           nprocs=2, join=True, start_method="spawn")
    a0, a1 = (json.loads((tmp_path / f"a.{r}").read_text()) for r in (0, 1))
    b0 = json.loads((tmp_path / "b.0").read_text())
    assert (a0["code"], a0["reason"], len(a0["losses"])) == (0, "signal", 3)
    assert a1["code"] == 0
    assert (b0["code"], b0["reason"], len(b0["losses"])) == (0, "completed", 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        straight = train(run_config(train=sections["train"]), tmp_path / "colocated")
    finally:
        torch.set_num_threads(threads)
    assert a0["losses"] + b0["losses"] == straight.losses


def test_two_drafter_ranks_ddp_split_equals_colocated_ddp(tmp_path: Path) -> None:
    """2 drafter ranks (DDP) fed by 1 target rank give the losses of 2 colocated DDP ranks: the same feeds, the same
    reservoirs, gradients averaged the same way."""
    sections = {"train": {"max_steps": 5, "checkpoint_every": 0}}
    split = {**sections, "dist": {"roles": "split", "target_ranks": 1}}
    mp.start_processes(_split_worker, args=(3, _free_port(), str(tmp_path / "split"), str(tmp_path / "s"), split),
                       nprocs=3, join=True, start_method="spawn")
    mp.start_processes(_split_worker, args=(2, _free_port(), str(tmp_path / "col"), str(tmp_path / "c"), sections),
                       nprocs=2, join=True, start_method="spawn")
    s = [json.loads((tmp_path / f"s.{r}").read_text()) for r in range(3)]
    c = [json.loads((tmp_path / f"c.{r}").read_text()) for r in range(2)]
    assert [x["code"] for x in s + c] == [0] * 5
    assert len(s[0]["losses"]) == 5
    assert s[0]["losses"] == c[0]["losses"] == s[1]["losses"] == c[1]["losses"]
    events = [json.loads(x) for x in (tmp_path / "split" / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["kind"] == "run_start")
    assert start["roles"] == {"drafter": [0, 1], "target": [2]}
    steps = [e for e in events if e["kind"] == "step"]
    assert len(steps) == 5 and all(e["rank"] == 0 for e in steps)


def test_a_stopped_peer_fails_the_run_with_the_timeout_named_instead_of_hanging(tmp_path: Path) -> None:
    """A target rank that stops answering (SIGSTOP: a real stuck process) makes its drafter fail after
    dist.timeout_s with an `nccl` error naming the timeout, not wait forever (gloo's default is 30 minutes)."""
    timeout_s = 20
    sections = {"train": {"max_steps": 5000, "epochs": 1000, "checkpoint_every": 0},
                "dist": {"roles": "split", "target_ranks": 1, "timeout_s": timeout_s}}
    out = tmp_path / "split"
    ctx = mp.start_processes(_split_worker, args=(2, _free_port(), str(out), str(tmp_path / "r"), sections),
                             nprocs=2, join=False, start_method="spawn")
    drafter, target = ctx.processes
    events = out / "events.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (events.is_file() and '"kind":"step"' in events.read_text()):
            assert time.monotonic() < deadline and drafter.is_alive(), "no step within 180 s"
            time.sleep(0.2)
        os.kill(target.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        drafter.join(timeout_s + 90)
        waited = time.monotonic() - stopped_at
        assert drafter.exitcode == 0, "the drafter process must end (its run ends in an error event)"
    finally:
        if target.is_alive():
            os.kill(target.pid, signal.SIGCONT)  # it now finds its drafter gone and ends too
        target.join(60)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    result = json.loads((tmp_path / "r.0").read_text())
    assert result["reason"] == "error" and result["code"] != 0
    assert timeout_s - 1 <= waited, f"failed after {waited:.1f} s, before the timeout: not the timeout"
    err = next(e for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "error" and e["rank"] == 0)
    assert err["class"] == "nccl" and err["fatal"]
    assert "timed out" in err["message"].lower() and f"dist.timeout_s = {timeout_s} s" in err["message"]


_TEARDOWN_PROBE = """
import atexit, os
if "LOCAL_RANK" in os.environ:  # torchrun's workers only, not the launcher
    _path = os.path.join(os.environ["TEARDOWN_PROBE_DIR"], "teardown." + os.environ["RANK"])
    atexit.register(lambda: open(_path, "w").close())
"""


@pytest.mark.parametrize("nproc", [2, 1])
def test_a_multi_rank_dflash_train_ends_without_interpreter_teardown(tmp_path: Path, nproc: int) -> None:
    """`dflash train` under torchrun with 2 ranks leaves by os._exit once the run is on disk: CI saw rank 0 hang in
    torch's process-group destructors after run_end. Probe: an atexit hook (sitecustomize) that marks teardown. With
    2 ranks no rank tears down, yet each exits 0 with its last lines flushed; one rank exits normally (the probe
    works)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_TEARDOWN_PROBE)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_run_yaml(train={"max_steps": 2, "checkpoint_every": 0})))
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{probe}:{repo}", "TEARDOWN_PROBE_DIR": str(probe), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        "-m", "dflash", "train", "--config", str(cfg_file), "--out", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "run_end: completed (exit 0) at step 2" in r.stdout + r.stderr  # flushed before leaving
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["kind"] == "run_end" and events[-1]["reason"] == "completed"
    torn_down = sorted(p.name for p in probe.glob("teardown.*"))
    assert torn_down == ([] if nproc > 1 else ["teardown.0"])


def test_a_buffer_is_prepared_on_the_host_for_either_packing_and_a_fixed_shape() -> None:
    """The host half of a buffer: varlen gets one packed row and its boundaries (with fixed_shape, always
    token_budget long, the padding tail one more document); pad gets right-padded rows. No tensor on a device."""
    from dflash.data import TokenizedCorpus
    from dflash.pipeline import prepare_buffer

    g = torch.Generator().manual_seed(0)
    corpus = TokenizedCorpus(ids=[torch.randint(1, 50, (n,), generator=g) for n in (12, 7, 30)],
                             loss_mask=[torch.ones(n, dtype=torch.bool) for n in (12, 7, 30)], fingerprint="t")
    pieces = [(0, 2, 10), (2, 5, 5), (1, 0, 7)]
    var = prepare_buffer(corpus, pieces, 32, "varlen")
    assert var.real == 22 and var.cu_seqlens is not None and var.packed_ids is not None and var.rows is None
    assert var.cu_seqlens.tolist() == [0, 10, 15, 22] and var.cu_seqlens.dtype == torch.int32
    assert torch.equal(var.packed_ids[0], torch.cat([corpus.ids[0][2:12], corpus.ids[2][5:10], corpus.ids[1]]))
    fixed = prepare_buffer(corpus, pieces, 32, "varlen", fixed_shape=True)
    assert fixed.cu_seqlens is not None and fixed.packed_ids is not None
    assert fixed.cu_seqlens.tolist() == [0, 10, 15, 22, 32] and fixed.packed_ids.shape == (1, 32)
    assert torch.equal(fixed.packed_ids[0, :22], var.packed_ids[0]) and not fixed.packed_ids[0, 22:].any()
    full = prepare_buffer(corpus, [(2, 0, 30), (0, 0, 2)], 32, "varlen", fixed_shape=True)
    assert full.cu_seqlens is not None and full.cu_seqlens.tolist() == [0, 30, 32]  # no tail: nothing to add
    pad = prepare_buffer(corpus, pieces, 32, "pad")
    assert pad.rows is not None and pad.packed_ids is None
    ids, att = pad.rows
    assert ids.shape == (3, 10) and att.sum(1).tolist() == [10, 5, 7]
    for buf in (var, fixed, pad):
        assert all(t.device.type == "cpu" for t in buf.arrays.values())
        assert torch.equal(buf.arrays["doc_ids"], var.arrays["doc_ids"])


def test_split_target_ranks_default_to_the_balanced_layout_for_the_world_size() -> None:
    """Left out, dist.target_ranks is the split that moves the most buffers per second at the measured 1.65 s target
    : 1.17 s drafter per buffer: 5 of 8 (3 drafters at 3/1.17 = 2.56 vs 4 of 8 starving on targets at 4/1.65 = 2.42)."""
    from dflash.pipeline import balanced_target_ranks

    assert [balanced_target_ranks(w) for w in (2, 3, 4, 8, 16)] == [1, 2, 2, 5, 9]
    assert balanced_target_ranks(8, target_s=1.0, drafter_s=1.0) == 4  # equal costs: half and half
    assert balanced_target_ranks(8, target_s=1.0, drafter_s=3.0) == 2
    for w in (2, 4, 8, 16):  # never worse than any other split
        t = balanced_target_ranks(w)
        best = max(min(k / 1.65, (w - k) / 1.17) for k in range(1, w))
        assert min(t / 1.65, (w - t) / 1.17) == best
    r = resolve_roles(DistConfig(roles="split"), {"RANK": "0", "WORLD_SIZE": "8"})
    assert (r.role, r.drafters, r.targets) == ("drafter", [0, 1, 2], [3, 4, 5, 6, 7])
    r = resolve_roles(DistConfig(roles="split", target_ranks=6), {"RANK": "7", "WORLD_SIZE": "8"})
    assert (r.role, r.drafters, r.targets) == ("target", [0, 1], [2, 3, 4, 5, 6, 7])  # an explicit value wins
    with pytest.raises(ValueError, match="needs at least 2 processes"):
        resolve_roles(DistConfig(roles="split"), {"WORLD_SIZE": "1"})
    with pytest.raises(ValueError, match="at least 2 ranks"):
        balanced_target_ranks(1)
