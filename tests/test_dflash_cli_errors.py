"""`dflash` refusals at the door, through the real console entry (`python -m dflash`): a bad config is checked whole
before torch is imported (every problem on its own line, exit 2), a mistyped command gets the nearest one, and
`--version` answers without importing torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def dflash(*args: str, cwd: Path, importtime: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "dflash", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def imported(stderr: str) -> set[str]:
    """Module names from `python -X importtime` (`import time: self | cumulative | name`)."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


BAD = """\
drafter:
  num_layrs: 2
  block_size: 1
train:
  lr: fast
  max_step: 10
trian:
  seed: 1
"""


def test_bad_config_reports_every_problem_before_importing_torch(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(BAD)
    out = tmp_path / "run"
    r = dflash("train", "--config", str(cfg), "--out", str(out), cwd=tmp_path, importtime=True)
    assert r.returncode == 2, r.stderr
    assert messages(r.stderr) == [
        f"dflash: {cfg}:2: drafter.num_layrs: unknown field (did you mean 'num_layers'?)",
        f"dflash: {cfg}:3: drafter.block_size: must be >= 2, got 1",
        f"dflash: {cfg}:5: train.lr: expected a number, got 'fast'",
        f"dflash: {cfg}:6: train.max_step: unknown field (did you mean 'max_steps'?)",
        f"dflash: {cfg}:7: trian: unknown field (did you mean 'train'?)",
    ]
    mods = imported(r.stderr)
    assert "dflash.config" in mods and "torch" not in mods and "transformers" not in mods
    assert r.stdout == "" and not out.exists()


def test_unknown_key_without_a_near_miss_lists_the_sections_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("target:\n  pretrain:\n    zzz: 1\n")
    r = dflash("preflight", "--config", str(cfg), cwd=tmp_path, importtime=True)
    assert r.returncode == 2
    assert messages(r.stderr) == [f"dflash: {cfg}:3: target.pretrain.zzz: unknown field (known: batch_size, cache_dir, "
                                  "lr, seq_len, steps, warmup_frac)"]
    assert "torch" not in imported(r.stderr)  # preflight imports torch first thing; the check comes before it


def test_target_arch_keys_are_still_checked_by_the_full_load(tmp_path: Path) -> None:
    """The one check the quick pass leaves out (target.arch's keys come from transformers, which imports torch)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("target:\n  arch:\n    num_hiden_layers: 4\n")
    r = dflash("train", "--config", str(cfg), "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert messages(r.stderr)[0].startswith(f"dflash: {cfg}:3: target.arch.num_hiden_layers: unknown "
                                            "Qwen3_5TextConfig field"), r.stderr


def test_every_field_of_every_section_is_a_known_key() -> None:
    """The known keys come from the section classes themselves: a field added to a section (data.*, ...) is accepted
    by the quick check without a list to update. Each section written out in full with its defaults passes."""
    from dflash.config import RunConfig, _section_class, config_from_dict, field_names

    full: dict[str, dict[str, object]] = {}
    for section in RunConfig.model_fields:
        cls = _section_class([section])
        values = cls().model_dump() if hasattr(cls, "model_dump") else dataclasses.asdict(cls())
        assert set(values) == set(field_names(cls)) and values, section
        full[section] = values
    config_from_dict(yaml.safe_load(yaml.safe_dump(full)), "<full>", quick=True)


@pytest.mark.parametrize(("word", "expected"), [
    ("trian", "dflash: unknown command 'trian'; did you mean 'train'?"),
    ("exprot", "dflash: unknown command 'exprot'; did you mean 'export'?"),
    ("zzz", "dflash: unknown command 'zzz' (commands: train, preflight, export, eval, data, pretrain-target, regen)"),
])
def test_mistyped_command_names_the_nearest_one(tmp_path: Path, word: str, expected: str) -> None:
    r = dflash(word, "--config", "x.yaml", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == expected and r.stdout == ""


def test_version_from_package_metadata_without_importing_torch(tmp_path: Path) -> None:
    r = dflash("--version", cwd=tmp_path, importtime=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"dflash {metadata.version('dflash-ops')} (torch {metadata.version('torch')}, "
                                f"transformers {metadata.version('transformers')}, python {sys.version.split()[0]})")
    assert "torch" not in imported(r.stderr)
