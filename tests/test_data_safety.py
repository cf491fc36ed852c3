"""Data safety (issue 21, items 1-3): one writer per run directory, data directory and cache entry; cache entries that
verify themselves and heal; a resume with a changed config refused before anything is built.

Real processes throughout: `dflash train` subprocesses on the tiny test config, and lock holders that are separate
processes (a lock is re-entrant inside one process, so the holder must be another one).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from dflash_fixtures import tiny_run_yaml, tokenizer_cache

from dflash import locks
from dflash.cache_entry import CONTENT, content_problem
from dflash.checkpoint import save_checkpoint
from dflash.cli import main
from dflash.config import config_from_dict
from dflash.data import load_tokenizer, read_documents
from dflash.pretrain import pretrain_key, resolve_target
from dflash.regen import RECORDS, regenerated_documents
from dflash.telemetry import read_events

REPO = Path(__file__).resolve().parents[1]
# A pretrained target that trains in a couple of seconds: these tests are about the cache, not the target's quality.
FAST_PRETRAIN = {"steps": 8, "batch_size": 4, "seq_len": 32, "lr": 5e-3}


def _write(tmp: Path, cfg: dict[str, Any], name: str = "run.yaml") -> Path:
    p = tmp / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def _dflash(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "dflash", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def _wait_for_event(out: Path, kind: str, proc: subprocess.Popen[str], timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        f = out / "events.jsonl"
        if f.exists() and any(e["kind"] == kind for e in read_events(f)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no {kind} event within {timeout}s")


def _snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


class Holder:
    """Another process holding a lock through dflash.locks (as a live trainer or regen would), until stopped."""

    def __init__(self, lock_file: Path) -> None:
        code = ("import sys; from dflash import locks; locks.acquire(sys.argv[1], 'held'); print('held', flush=True); "
                "sys.stdin.read()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(lock_file)], cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "held"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------------------------------- 1. one writer
def test_a_second_trainer_on_the_same_out_is_refused_naming_the_first_and_a_killed_one_leaves_no_lock(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, tiny_run_yaml(train={"max_steps": 100000, "checkpoint_every": 2, "heartbeat_s": 0.2}))
    out = tmp_path / "out"
    first = _dflash("train", "--config", str(path), "--out", str(out))
    try:
        _wait_for_event(out, "checkpoint", first)
        # `--resume auto` while the first trains: before the lock it resumed from the last checkpoint and both wrote
        code, _, err = _finish(_dflash("train", "--config", str(path), "--out", str(out), "--resume", "auto"))
        assert code == 2, err
        line = err.strip()
        assert line.count("\n") == 0 and "Traceback" not in line, err
        assert line == (f"dflash: {out} is in use by pid {first.pid} on {socket.gethostname()} (lock "
                        f"{out / 'run.lock'}); another dflash train writes there: stop it first (opsctl kill, or "
                        "SIGTERM that pid), or use another --out")
        # `--fresh` is refused the same way, before it deletes anything (this test process is a third one)
        assert main(["train", "--config", str(path), "--out", str(out), "--fresh"]) == 2
        assert f"is in use by pid {first.pid} on " in capsys.readouterr().err
        assert first.poll() is None
        assert list((out / "checkpoints").glob("step-*"))
    finally:
        first.send_signal(signal.SIGKILL)  # a crash: the OS drops the lock, nobody has to delete a file
        first.wait()
    evs = list(read_events(out / "events.jsonl"))
    assert [e["kind"] for e in evs].count("run_start") == 1  # the refused ones wrote nothing
    steps = [e["step"] for e in evs if e["kind"] == "step"]
    assert len(steps) == len(set(steps))
    assert json.loads((out / "run.lock").read_text())["pid"] == first.pid  # the file stays, the lock does not
    assert main(["train", "--config", str(path), "--out", str(out), "--fresh", "--max-steps", "2"]) == 0
    assert list(read_events(out / "events.jsonl"))[-1]["reason"] == "completed"


def test_a_save_removes_only_its_own_or_dead_processes_temp_dirs(tmp_path: Path) -> None:
    """Two trainers on one OUT: the second's save deleted the first's `.tmp-step-N-PID` mid-write
    (FileNotFoundError .../drafter.pt). A live process's temp dir is left alone."""
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        root = tmp_path / "checkpoints"
        theirs = root / f".tmp-step-10-{live.pid}"
        crashed = root / f".tmp-step-10-{dead.pid}"
        mine = root / f".tmp-step-7-{os.getpid()}"
        legacy = root / ".tmp-step-3"
        for d in (theirs, crashed, mine, legacy):
            d.mkdir(parents=True)
            (d / "drafter.pt").write_bytes(b"x")
        save_checkpoint(tmp_path, 12, {"a.json": b"{}"})
        assert (theirs / "drafter.pt").is_file()
        assert not crashed.exists() and not mine.exists() and not legacy.exists()
        assert (root / "step-12" / "a.json").is_file()
    finally:
        live.kill()
        live.wait()


def _random_target_yaml(tmp_path: Path) -> Path:
    return _write(tmp_path, tiny_run_yaml(), "random.yaml")


@pytest.mark.parametrize("command", ["regen", "pretrain-target"])
def test_a_second_regen_or_pretrain_into_one_directory_is_refused_naming_the_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    cfg = _random_target_yaml(tmp_path)
    dst = tmp_path / "dst"
    holder = Holder(locks.sibling_lock(dst))
    try:
        assert main([command, "--config", str(cfg), "--out", str(dst)]) == 2
    finally:
        holder.stop()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"dflash: {dst} is in use by pid {holder.proc.pid} on {socket.gethostname()} (lock "
                          f"{tmp_path / '.dst.lock'}); another ")
    assert not dst.exists()


def test_two_runs_at_once_on_a_fresh_cache_build_the_target_once_and_the_second_reuses_it(tmp_path: Path) -> None:
    """Both wait while another process builds the entry, one builds it when it is free, the other waits for that one
    and then reuses the finished entry (before: both pretrained, or one failed)."""
    y = _fast_pretrain_yaml(tmp_path / "cache")
    y["train"].update({"max_steps": 2, "checkpoint_every": 0})
    cfg_file = _write(tmp_path, y)
    entry = _target_entry(y)
    builder = Holder(locks.sibling_lock(entry))
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [_dflash("train", "--config", str(cfg_file), "--out", str(o)) for o in outs]
    try:
        deadline = time.time() + 180
        waiting = f"target cache entry {entry} is in use by pid {builder.proc.pid} on {socket.gethostname()}: waiting"
        while not all((o / "train.log").is_file() and waiting in (o / "train.log").read_text() for o in outs):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        builder.stop()  # gone without building: one of the two builds it, the other waits for that one
        results = [_finish(p) for p in procs]
    finally:
        builder.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r[0] for r in results] == [0, 0], results
    logs = [(o / "train.log").read_text() for o in outs]
    built = [log for log in logs if "pretraining target.arch on the corpus" in log]
    assert len(built) == 1, logs
    assert sum(f"target: pretrained {entry} (cached)" in log for log in logs) == 1
    assert content_problem(entry) is None


# ---------------------------------------------------------------------------------------------- 2. cache entries
def _fast_pretrain_yaml(cache: Path, regen: dict[str, Any] | None = None) -> dict[str, Any]:
    y = tiny_run_yaml()
    y["target"]["arch"].pop("initializer_range", None)
    y["target"]["pretrain"] = {**FAST_PRETRAIN, "cache_dir": str(cache)}
    if regen is not None:
        y["target"]["regen"] = {**regen, "cache_dir": str(cache)}
    return y


def _target_entry(y: dict[str, Any]) -> Path:
    cfg = config_from_dict(y, "<t>")
    docs = read_documents(cfg.data)
    tok = load_tokenizer(cfg.data, docs, cfg.data.tokenizer_cache or tokenizer_cache())
    return Path(y["target"]["pretrain"]["cache_dir"]) / f"target-{pretrain_key(cfg, docs, tok)}"


def _resolve(y: dict[str, Any]) -> tuple[Any, list[str]]:
    said: list[str] = []
    cfg = config_from_dict(y, "<t>")
    return resolve_target(cfg, read_documents(cfg.data), log=said.append), said


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage", ["model.safetensors", "pretrain.json", "legacy model.safetensors"])
def test_a_damaged_cached_target_is_rebuilt_naming_the_file(tmp_path: Path, damage: str) -> None:
    from transformers import AutoModelForCausalLM

    y = _fast_pretrain_yaml(tmp_path / "cache")
    cfg, said = _resolve(y)
    entry = Path(cfg.target.path)
    assert said[0].startswith("target: pretraining") and content_problem(entry) is None
    name = damage.split()[-1]
    if damage.startswith("legacy"):  # an entry written before content records: its structure is checked
        (entry / CONTENT).unlink()
    _truncate(entry / name)
    again, said = _resolve(y)
    assert again.target.path == str(entry)
    assert said[0].startswith(f"target: cache entry {entry} is damaged ({entry / name}: ")
    assert said[0].endswith("): rebuilding it") and len([s for s in said if "damaged" in s]) == 1
    assert content_problem(entry) is None
    AutoModelForCausalLM.from_pretrained(str(entry))  # whole again
    _, said = _resolve(y)
    assert said == [f"target: pretrained {entry} (cached)"]


def test_an_entry_of_an_older_dflash_is_adopted_when_whole(tmp_path: Path) -> None:
    y = _fast_pretrain_yaml(tmp_path / "cache")
    cfg, _ = _resolve(y)
    entry = Path(cfg.target.path)
    stamp = (entry / "model.safetensors").stat().st_mtime_ns
    (entry / CONTENT).unlink()
    _, said = _resolve(y)
    assert said == [f"target: pretrained {entry} (cached)"]
    assert content_problem(entry) is None and (entry / "model.safetensors").stat().st_mtime_ns == stamp


REGEN = {"num_prompts": 16, "prompt_tokens": 12, "max_new_tokens": 8}


@pytest.mark.parametrize("legacy", [False, True])
def test_regen_records_cut_at_a_line_boundary_are_regenerated(tmp_path: Path, legacy: bool) -> None:
    """complete.json said 16 records were made; a regen.jsonl cut at a line boundary parses fine and trained on half."""
    y = _fast_pretrain_yaml(tmp_path / "cache", REGEN)
    cfg, _ = _resolve(y)
    raw = read_documents(cfg.data)
    said: list[str] = []
    docs = regenerated_documents(cfg, raw, log=said.append)
    where = Path(said[0].rsplit("cached as ", 1)[1].rstrip(")"))
    records = where / RECORDS
    lines = records.read_text().splitlines(keepends=True)
    assert len(docs) == len(lines) == 16
    if legacy:
        (where / CONTENT).unlink()
    records.write_text("".join(lines[:8]))
    said = []
    again = regenerated_documents(cfg, raw, log=said.append)
    assert said[0].startswith(f"data: cache entry {where} is damaged ({records}: ")
    assert said[0].endswith("): regenerating it")
    assert [d.ids for d in again] == [d.ids for d in docs]
    said = []
    regenerated_documents(cfg, raw, log=said.append)
    assert said == [f"data: the target's regenerated records {where} (cached)"]


def test_a_copied_cache_finds_its_regenerated_records(tmp_path: Path) -> None:
    """Records were keyed by the target's absolute path: a copied or moved cache regenerated them (minutes)."""
    y = _fast_pretrain_yaml(tmp_path / "cache", REGEN)
    cfg, _ = _resolve(y)
    raw = read_documents(cfg.data)
    docs = regenerated_documents(cfg, raw, log=lambda _m: None)
    shutil.copytree(tmp_path / "cache", tmp_path / "copy")
    shutil.rmtree(tmp_path / "cache")
    moved = _fast_pretrain_yaml(tmp_path / "copy", REGEN)
    cfg2, said = _resolve(moved)
    assert said == [f"target: pretrained {cfg2.target.path} (cached)"]
    said = []
    assert [d.ids for d in regenerated_documents(cfg2, raw, log=said.append)] == [d.ids for d in docs]
    assert len(said) == 1 and said[0].startswith(f"data: the target's regenerated records {tmp_path / 'copy'}")
    assert said[0].endswith("(cached)")


# ---------------------------------------------------------------------------------------------- 3. resume checks
def test_resume_with_a_changed_drafter_is_refused_naming_the_fields_and_changes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    y = tiny_run_yaml(train={"max_steps": 2, "checkpoint_every": 0})
    path = _write(tmp_path, y)
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--out", str(out)]) == 0
    before = _snapshot(out)
    changed = tiny_run_yaml(train={"max_steps": 4, "checkpoint_every": 0, "seed": 1},
                            drafter={"num_layers": 2, "num_heads": 4})
    changed_path = _write(tmp_path, changed, "changed.yaml")
    code, _, err = _finish(_dflash("train", "--config", str(changed_path), "--out", str(out), "--resume"))
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.strip() == (
        f"dflash: {out / 'checkpoints' / 'step-2'}: refusing to resume with a changed config: drafter.num_heads: 2 in "
        "the checkpoint, 4 in the config; drafter.num_layers: 1 in the checkpoint, 2 in the config; train.seed: 0 in "
        "the checkpoint, 1 in the config. Restore these fields to resume, or start a new run (--fresh, or another "
        "--out)")
    assert _snapshot(out) == before
    # what may change on resume: the run's length, how often it saves and reports
    capsys.readouterr()
    free = tiny_run_yaml(train={"max_steps": 4, "checkpoint_every": 1, "log_every": 2, "heartbeat_s": 0.3,
                                "keep_last": 1}, drafter={"attention": "dense"})
    assert main(["train", "--config", str(_write(tmp_path, free, "free.yaml")), "--out", str(out), "--resume"]) == 0
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-4"]


def test_resume_with_a_changed_target_is_refused_before_pretraining_it(tmp_path: Path) -> None:
    """A changed target hidden size was refused only after ~65 s of pretraining a new target, with a message about
    schedule.json and the corpus."""
    cache = tmp_path / "cache"
    y = _fast_pretrain_yaml(cache)
    y["train"].update({"max_steps": 2, "checkpoint_every": 0})
    out = tmp_path / "out"
    assert main(["train", "--config", str(_write(tmp_path, y)), "--out", str(out)]) == 0
    entries = sorted(p.name for p in cache.iterdir())
    before = _snapshot(out)
    y["target"]["arch"]["hidden_size"] = 64
    code, _, err = _finish(_dflash("train", "--config", str(_write(tmp_path, y, "wider.yaml")), "--out", str(out),
                                   "--resume", "auto", "--max-steps", "4"))
    assert code == 2
    assert err.strip().endswith(": refusing to resume with a changed config: target.arch.hidden_size: 32 in the "
                                "checkpoint, 64 in the config. Restore these fields to resume, or start a new run "
                                "(--fresh, or another --out)"), err
    assert sorted(p.name for p in cache.iterdir()) == entries  # no new target was pretrained
    assert _snapshot(out) == before


def test_a_checkpoint_from_before_a_config_field_existed_still_resumes() -> None:
    """Fields added to the config since the checkpoint was saved take their defaults on both sides: an upgrade of
    dflash alone never makes a resume refused."""
    from dflash.rundir import resume_config_differences

    cfg = config_from_dict(tiny_run_yaml(), "<t>")
    saved = cfg.to_dict()
    del saved["target"]["attention"], saved["drafter"]["layer_sliding_windows"], saved["train"]["final_save_wait_s"]
    assert resume_config_differences(saved, cfg) == []
    saved["drafter"]["block_size"] = 8
    saved["target"]["arch"].pop("head_dim")
    assert resume_config_differences(saved, cfg) == [
        "drafter.block_size: 8 in the checkpoint, 4 in the config",
        "target.arch.head_dim: null in the checkpoint, 16 in the config"]
