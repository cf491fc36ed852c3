"""Warm starts of the compiled drafter step (issue 11 item 5): the mega-cache artifacts a run saves in
OUT/compile_cache are loaded by its next attempt when their key matches, ignored with a reason when not.

Real `dflash train` processes with `train.compile: true` (inductor, C++ on CPU). Each resume runs on a copy of the
first run's inductor cache without its `fxgraph` and `aotautograd` dirs: the FX graph and AOT autograd lookups then
hit only if the artifacts filled them, while the compiled C++ libraries (found by source hash) keep each run short.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash_fixtures import tiny_run_yaml  # noqa: E402

from dflash import compile_cache  # noqa: E402
from dflash.telemetry import read_events  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "events.md"
CACHE_ENV = ("DFLASH_WARM_START", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
             "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@dataclass
class Primed:
    """A finished 2-step compiled run, its inductor cache, and its first attempt's output."""

    config: Path
    out: Path
    cache: Path
    first: subprocess.CompletedProcess[str]


def train(config: Path, out: Path, cache: Path, *extra: str,
          env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    # as opsctl's launch wrapper sets it: Triton's cache inside the inductor cache (empty on CPU but for PLANTED)
    env.update(PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"),
               **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "dflash", "train", "--config", str(config), "--out", str(out),
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def attempt(out: Path) -> list[dict[str, Any]]:
    """The events of the newest attempt (from its run_start on)."""
    evs = list(read_events(out / "events.jsonl"))
    start = max(i for i, e in enumerate(evs) if e["kind"] == "run_start")
    return evs[start:]


def compiling(evs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in evs if e["kind"] == "phase" and e["phase"] == "compiling")


def first_step(evs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in evs if e["kind"] == "step")


@pytest.fixture(scope="module")
def primed(tmp_path_factory: pytest.TempPathFactory) -> Primed:
    base = tmp_path_factory.mktemp("warm")
    # log_every 5: the first compiled step of an attempt is written anyway (it carries first_step_s).
    cfg = tiny_run_yaml(train={"compile": "true", "max_steps": 2, "checkpoint_every": 0, "log_every": 5})
    config = base / "run.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    out, cache = base / "out", base / "inductor"
    plant_triton_entry(cache / "triton")
    first = train(config, out, cache)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return Primed(config, out, cache, first)


# A stand-in for what fla's first calls leave in Triton's cache on a GPU (Triton is absent on CPU machines): Triton's
# documented layout, one directory per kernel named by its cache key's hash, holding the binary, its metadata and
# the autotuner's results.
PLANTED = "Q3ZLXKWJ7TQ2YV4XN5M6BO7CP8DQ9ERAFSBGTCHUDIVEJWFKXGLYHMZI"
PLANTED_FILES = {"chunk_fwd_kernel_h.cubin": os.urandom(3000), "chunk_fwd_kernel_h.json": b'{"num_warps": 4}',
                 "chunk_fwd_kernel_h.autotune.json": b'{"configs_timings": [[{"BV": 64}, 0.011]]}'}


def plant_triton_entry(root: Path) -> None:
    (root / PLANTED).mkdir(parents=True, exist_ok=True)
    for name, data in PLANTED_FILES.items():
        (root / PLANTED / name).write_bytes(data)


def resume_setup(primed: Primed, tmp_path: Path, strip: bool = True) -> tuple[Path, Path]:
    """A copy of the primed run dir, and of its inductor cache minus (strip) the FX graph and AOT autograd entries."""
    out, cache = tmp_path / "out", tmp_path / "inductor"
    shutil.copytree(primed.out, out)
    shutil.copytree(primed.cache, cache, ignore=shutil.ignore_patterns(
        *(("fxgraph", "aotautograd", "locks") if strip else ("locks",))))
    assert (cache / "fxgraph").exists() != strip and (cache / "aotautograd").exists() != strip
    return out, cache


def check_saved(out: Path) -> dict[str, Any]:
    """The artifacts file on disk is whole and carries this torch's key."""
    meta = json.loads((out / "compile_cache" / "artifacts.json").read_text())
    blob = (out / "compile_cache" / "artifacts.bin").read_bytes()
    assert meta["sha256"] == hashlib.sha256(blob).hexdigest() and meta["bytes"] == len(blob)
    assert meta["key"]["torch"] == torch.__version__ and meta["artifacts"]["inductor"] >= 1
    return meta


def test_first_compiled_attempt_saves_artifacts_and_reports_a_cold_first_step(primed: Primed) -> None:
    evs = attempt(primed.out)
    warm = compiling(evs)["warm_start"]
    assert warm["used"] is False and "no saved artifacts" in warm["reason"]
    assert compiling(evs)["detail"] == "the first step compiles the drafter; cold: no usable saved artifacts"
    step = first_step(evs)
    assert step["step"] == 1  # written although log_every is 5
    assert step["warm_start"] is False and step["first_step_s"] > 0
    assert step["compile_cache"]["fxgraph_miss"] >= 1 and step["compile_cache"]["fxgraph_hit"] == 0
    assert [e["step"] for e in evs if e["kind"] == "step"] == [1, 2]
    meta = check_saved(primed.out)
    assert meta["artifacts"]["aot_autograd"] >= 1
    assert "compile artifacts saved" in primed.first.stdout


def test_resume_loads_the_artifacts_and_its_compile_hits_the_caches(primed: Primed, tmp_path: Path) -> None:
    out, cache = resume_setup(primed, tmp_path)
    r = train(primed.config, out, cache, "--resume", "--max-steps", "3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evs = attempt(out)
    assert evs[0]["resumed_from"] == 2
    warm = compiling(evs)["warm_start"]
    assert warm["used"] is True and warm["reason"].startswith("loaded "), warm
    assert compiling(evs)["detail"].endswith("; warm: the run's saved artifacts")  # what status and watch show
    assert warm["artifacts"]["inductor"] >= 1 and warm["artifacts"]["aot_autograd"] >= 1
    assert warm["bytes"] == (primed.out / "compile_cache" / "artifacts.bin").stat().st_size
    step = first_step(evs)
    assert step["step"] == 3 and step["warm_start"] is True
    counts = step["compile_cache"]
    # Every graph the step needed came from the loaded artifacts: nothing was compiled from scratch.
    assert counts["fxgraph_hit"] >= 1 and counts["fxgraph_miss"] == 0, counts
    assert counts["aotautograd_hit"] >= 1 and counts["aotautograd_miss"] == 0, counts
    assert re.search(r"warm start used: loaded \d+ inductor", r.stdout)
    assert re.search(r"first compiled step: [\d.]+ s \(warm start used", r.stdout)
    assert evs[-1]["kind"] == "run_end" and evs[-1]["reason"] == "completed"


def test_a_resume_on_an_emptied_cache_gets_the_triton_kernels_back(primed: Primed, tmp_path: Path) -> None:
    """fla's Triton kernels (and their autotune results) are not in torch's mega-cache: the first attempt carries the
    Triton cache in OUT/compile_cache, and a resume whose cache was emptied (opsctl's `clear`, a new host) has
    them back, byte for byte, before the target's first forward."""
    assert re.search(r"Triton kernels carried: 1 entries", primed.first.stdout), primed.first.stdout[-2000:]
    out, cache = resume_setup(primed, tmp_path)
    shutil.rmtree(cache / "triton")
    r = train(primed.config, out, cache, "--resume", "--max-steps", "3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"triton kernels: restored 1 Triton kernel entries .* 0 were already", r.stdout), r.stdout[-3000:]
    assert {f.name: f.read_bytes() for f in (cache / "triton" / PLANTED).iterdir()} == PLANTED_FILES
    assert not [p for p in (cache / "triton").iterdir() if p.name.startswith(".dflash-carry")]
    assert "Triton kernels unchanged (1 entries" in r.stdout  # nothing new: the archive is not rewritten
    # DFLASH_WARM_START=0 restores nothing either (a cold start on purpose)
    out2, cache2 = resume_setup(primed, tmp_path / "cold")
    shutil.rmtree(cache2 / "triton")
    env_off = {**os.environ, "DFLASH_WARM_START": "0"}
    r = subprocess.run([sys.executable, "-m", "dflash", "train", "--config", str(primed.config), "--out", str(out2),
                        "--resume", "--max-steps", "3"], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**{k: v for k, v in env_off.items() if k not in CACHE_ENV[1:]}, "PYTHONUNBUFFERED": "1",
                            "TORCHINDUCTOR_CACHE_DIR": str(cache2), "TRITON_CACHE_DIR": str(cache2 / "triton")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "restored" not in r.stdout and not (cache2 / "triton" / PLANTED).exists()
    assert compiling(attempt(out2))["detail"].endswith("; cold: DFLASH_WARM_START=0")


def test_artifacts_with_another_key_are_ignored_with_the_reason(primed: Primed, tmp_path: Path) -> None:
    out, cache = resume_setup(primed, tmp_path)
    meta_path = out / "compile_cache" / "artifacts.json"
    meta = json.loads(meta_path.read_text())
    meta["key"]["torch"] = "2.11.0+cu130"  # what the GPU machine's torch writes
    meta_path.write_text(json.dumps(meta))
    r = train(primed.config, out, cache, "--resume", "--max-steps", "3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evs = attempt(out)
    warm = compiling(evs)["warm_start"]
    assert warm["used"] is False
    assert f"key changed (torch 2.11.0+cu130 -> {torch.__version__})" in warm["reason"], warm
    assert "warm start not used: ignored" in r.stdout
    step = first_step(evs)
    assert step["warm_start"] is False and step["compile_cache"]["fxgraph_miss"] >= 1  # compiled again
    assert check_saved(out)["key"]["torch"] == torch.__version__  # replaced by this torch's artifacts


def test_corrupt_artifacts_mean_no_warm_start_not_a_crash(primed: Primed, tmp_path: Path) -> None:
    """Garbage bytes with a matching sha256 (a file torch itself wrote badly) reach torch's loader, which must fail
    without taking the run down. The inductor cache is kept whole here, so the run goes on at disk-cache speed."""
    out, cache = resume_setup(primed, tmp_path, strip=False)
    blob, meta_path = out / "compile_cache" / "artifacts.bin", out / "compile_cache" / "artifacts.json"
    bad = os.urandom(4096)
    blob.write_bytes(bad)
    meta = json.loads(meta_path.read_text())
    meta.update(bytes=len(bad), sha256=hashlib.sha256(bad).hexdigest())
    meta_path.write_text(json.dumps(meta))
    r = train(primed.config, out, cache, "--resume", "--max-steps", "3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evs = attempt(out)
    warm = compiling(evs)["warm_start"]
    assert warm["used"] is False and "torch could not" in warm["reason"], warm
    assert "warm start not used: ignored" in r.stdout
    step = first_step(evs)
    assert step["step"] == 3 and step["warm_start"] is False
    assert evs[-1]["kind"] == "run_end" and evs[-1]["reason"] == "completed"
    assert not [e for e in evs if e["kind"] == "error"]
    check_saved(out)  # the next attempt has good artifacts again


def test_a_truncated_file_is_refused_before_torch_sees_it(primed: Primed, tmp_path: Path) -> None:
    """A crash between writing the blob and its key file, or a disk that lost the tail: the sha256 check says so
    (in-process: load() returns before calling torch, so no compile state of this test process changes)."""
    out = tmp_path / "out"
    shutil.copytree(primed.out / "compile_cache", out / "compile_cache")
    key = json.loads((out / "compile_cache" / "artifacts.json").read_text())["key"]
    caches = {"fx_graph_cache": True, "autograd_cache": True}
    blob = out / "compile_cache" / "artifacts.bin"
    blob.write_bytes(blob.read_bytes()[:1000])
    warm = compile_cache.load(out, key, caches)
    assert not warm.used and "corrupt (1000 bytes" in warm.reason, warm
    blob.unlink()
    warm = compile_cache.load(out, key, caches)
    assert not warm.used and "unreadable" in warm.reason, warm
    (out / "compile_cache" / "artifacts.json").write_text("{not json")
    assert "unreadable" in compile_cache.load(out, key, caches).reason
    off = compile_cache.load(out, key, {"fx_graph_cache": False, "autograd_cache": True})
    assert not off.used and "fx_graph_cache is disabled" in off.reason


def test_a_cold_start_can_be_asked_for(primed: Primed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DFLASH_WARM_START=0 (a compile from nothing on purpose): a good, matching file is not loaded, and says why."""
    out = tmp_path / "out"
    shutil.copytree(primed.out / "compile_cache", out / "compile_cache")
    key = json.loads((out / "compile_cache" / "artifacts.json").read_text())["key"]
    monkeypatch.setenv("DFLASH_WARM_START", "0")
    warm = compile_cache.load(out, key, {"fx_graph_cache": True, "autograd_cache": True})
    assert not warm.used and warm.reason == "not loaded: DFLASH_WARM_START=0"


def fresh_cache(primed: Primed, cache: Path) -> Path:
    """A new run's inductor cache, as the resumes above get it: the primed one without its FX graph and AOT autograd
    entries (those lookups then hit only through loaded artifacts), its C++ libraries kept (found by source hash: no
    C++ compile of minutes on 2 cores for each run, which is not what is checked)."""
    shutil.copytree(primed.cache, cache, ignore=shutil.ignore_patterns("fxgraph", "aotautograd", "locks"))
    return cache


def test_a_new_run_of_the_same_graph_starts_warm_from_this_host_s_copy(primed: Primed, tmp_path: Path) -> None:
    """Another --out, another inductor cache without FX graph / AOT autograd entries (a new run with another
    learning rate or data, opsctl's `clear`): the first run's artifacts come from this host's copy under
    $DFLASH_CACHE/compile-cache, nothing compiles from scratch, and the new run keeps its own copy in its OUT too.
    DFLASH_HOST_COMPILE_CACHE=0 keeps runs apart."""
    on = {"DFLASH_CACHE": str(tmp_path / "dcache"), "DFLASH_HOST_COMPILE_CACHE": "1"}
    a = train(primed.config, tmp_path / "a", fresh_cache(primed, tmp_path / "ind-a"), env_extra=on)
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    (host,) = (tmp_path / "dcache" / "compile-cache").iterdir()
    assert f"this host's copy saved in {host}" in a.stdout
    assert (host / "artifacts.bin").read_bytes() == (tmp_path / "a" / "compile_cache" / "artifacts.bin").read_bytes()

    b = train(primed.config, tmp_path / "b", fresh_cache(primed, tmp_path / "ind-b"), env_extra=on)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    evs = attempt(tmp_path / "b")
    warm = compiling(evs)["warm_start"]
    assert warm["used"] is True and warm["path"] == str(host / "artifacts.bin"), warm
    assert "this host's copy of the same graph" in warm["reason"]
    assert compiling(evs)["detail"].endswith("; warm: this host's copy")
    counts = first_step(evs)["compile_cache"]
    assert counts["fxgraph_hit"] >= 1 and counts["fxgraph_miss"] == 0, counts
    assert counts["aotautograd_hit"] >= 1 and counts["aotautograd_miss"] == 0, counts
    check_saved(tmp_path / "b")  # its own copy, for its resumes on another host
    assert re.search(r"this host's copy (unchanged|saved in)", b.stdout)  # torch's bytes differ run to run

    c = train(primed.config, tmp_path / "c", fresh_cache(primed, tmp_path / "ind-c"),
              env_extra={**on, "DFLASH_HOST_COMPILE_CACHE": "0"})
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    evs = attempt(tmp_path / "c")
    assert compiling(evs)["warm_start"]["used"] is False
    assert first_step(evs)["compile_cache"]["fxgraph_miss"] >= 1
    assert "this host's copy" not in c.stdout


def test_this_host_s_copies_keep_the_newest_keys_and_remove_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "compile-cache"
    keys = [f"{i:016x}" for i in range(10)]
    for i, k in enumerate(keys):
        (root / k).mkdir(parents=True)
        (root / k / "artifacts.bin").write_bytes(b"x")
        os.utime(root / k, (1000 + i, 1000 + i))
    (root / "notes").mkdir()  # not a key directory: never removed
    os.utime(root / "notes", (1, 1))
    (root / "0123456789abcdef").symlink_to(tmp_path / "elsewhere")  # a link named like a key: never followed
    assert compile_cache.prune_host(root, 8) == 2
    assert sorted(p.name for p in root.iterdir()) == sorted([*keys[2:], "notes", "0123456789abcdef"])


def test_the_warm_start_fields_are_documented() -> None:
    """The contract: what the trainer adds to `phase` and `step` is in docs/events.md."""
    text = DOC.read_text()
    phase = text.split("### `phase`", 1)[1].split("###", 1)[0]
    step = text.split("### `step`", 1)[1].split("###", 1)[0]
    assert "`warm_start`" in phase
    ws = compile_cache.WarmStart(True, "x").event()
    for key in ws:
        assert f"`{key}`" in phase, key
    for key in ("first_step_s", "warm_start", "compile_cache"):
        assert f"`{key}`" in step, key
    for key in compile_cache.counters():
        assert f"`{key}`" in step, key
