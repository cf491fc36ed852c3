"""bench/quality_h200.py's pure parts (the seed summary, the method comparison, the call budget) and its refusal of
an --out made with another recipe (a real process, on CPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "quality_h200.py"


@pytest.fixture(scope="module")
def qb() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quality_h200", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_median_spread_skips_undefined_seeds_and_averages_the_middle_two(qb: ModuleType) -> None:
    s = qb.median_spread([5.0, None, 3.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (4.0, 3.0, 5.0, 3)
    assert s["values"] == [5.0, None, 3.0, 4.0]  # per seed, as measured
    assert qb.median_spread([1.0, 2.0, 3.0, 4.0])["median"] == 2.5
    empty = qb.median_spread([None, None])
    assert empty["median"] is None and empty["n"] == 0


def test_seed_summary_takes_the_median_of_per_seed_ratios_not_the_ratio_of_medians(qb: ModuleType) -> None:
    per_seed = {"0": {"B16": {"tau": 4.0, "ngram_tau": 2.0}, "B8": {"tau": 3.0, "ngram_tau": 2.0}},
                "1": {"B16": {"tau": 6.0, "ngram_tau": 2.0}, "B8": {"tau": 3.5, "ngram_tau": 2.0}},
                "2": {"B16": {"tau": 5.0, "ngram_tau": 5.0}, "B8": {"tau": 2.5, "ngram_tau": None}}}
    got = qb.seed_summary(per_seed)
    assert list(got) == ["B16", "B8"]  # largest block first, as the table prints them
    b16 = got["B16"]
    assert b16["tau"]["median"] == 5.0 and b16["ngram_tau"]["median"] == 2.0
    # ratios 2.0, 3.0, 1.0: median 2.0 (the ratio of the medians would say 2.5)
    assert (b16["ratio"]["median"], b16["ratio"]["min"], b16["ratio"]["max"]) == (2.0, 1.0, 3.0)
    # a seed without prompt lookup's tau has no ratio: left out, not counted as 0
    assert got["B8"]["ratio"]["n"] == 2 and got["B8"]["ratio"]["median"] == pytest.approx(1.625)
    lines = qb.format_summary(got)
    assert lines[1].split()[:4] == ["16", "5.00", "[4.00-6.00]", "2.00"]


def _result(dflash: list[list[int]], ngram: list[list[int]], tau: float, ngram_tau: float) -> dict:
    return {"tau": tau, "accepted": dflash, "accept_by_position": [0.5],
            "baseline": {"ngram": {"tau": ngram_tau, "accepted": ngram}}}


def test_compare_methods_accepts_a_difference_only_where_a_numerical_tie_is_named(qb: ModuleType) -> None:
    decode = _result([[3, 1], [2, 2]], [[0, 1], [1]], 3.0, 1.5)
    same = _result([[3, 1], [2, 2]], [[0, 1], [1]], 3.0, 1.5)
    cmp = qb.compare_methods(decode, same, {})
    assert cmp["equal"] and cmp["agree"] and cmp["differing"] == []
    assert cmp["tau"] == {"decode": 3.0, "teacher_forced": 3.0}

    other = _result([[3, 1], [2, 5]], [[0, 1], [1, 0]], 3.2, 1.6)  # prompt 1 differs in both methods
    cmp = qb.compare_methods(decode, other, {})
    assert not cmp["equal"] and not cmp["agree"]
    assert {(d["prompt"], d["method"]) for d in cmp["differing"]} == {(1, "dflash"), (1, "ngram")}
    # named ties for both explain both; one alone does not
    half = qb.compare_methods(decode, other, {(1, "dflash"): "decode tie at new token 7"})
    assert not half["agree"]
    both = qb.compare_methods(decode, other, {(1, "dflash"): "tie", (1, "ngram"): "tie"})
    assert both["agree"] and not both["equal"]
    # a prompt missing from one side is a difference no tie explains
    short = _result([[3, 1]], [[0, 1]], 3.0, 1.5)
    assert not qb.compare_methods(decode, short, {(1, "dflash"): "tie", (1, "ngram"): "tie"})["agree"]


def test_a_unit_that_would_overrun_the_call_is_deferred_but_never_the_first(qb: ModuleType) -> None:
    assert qb.fits(300.0, 200.0, 540.0, True)
    assert not qb.fits(400.0, 200.0, 540.0, True)
    assert qb.fits(400.0, 200.0, 540.0, False)  # nothing ran yet in this call: deferring would never progress
    assert qb.fits(10_000.0, 200.0, 0.0, True)  # no limit


def test_an_out_pretrained_with_another_recipe_is_refused_in_one_line(tmp_path: Path) -> None:
    """The old bench budgeted pretraining in seconds and wrote OUT/target for 2400 planned steps: reusing it would
    evaluate another target than the recipe's, so the bench refuses it (exit 2, naming the directory)."""
    out = tmp_path / "q"
    (out / "target").mkdir(parents=True)
    (out / "target" / "pretrain.json").write_text(json.dumps({"key": "0123456789abcdef", "steps_done": 189,
                                                              "settings": {"steps": 2400}}))
    empty = tmp_path / "no-gutenberg"
    empty.mkdir()
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--stage", "data",
                        "--gutenberg", str(empty)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in r.stderr
    assert err[0].startswith("refused: ") and str(out / "target") in err[0] and "another recipe" in err[0]
    assert (out / "target" / "pretrain.json").is_file()  # nothing deleted
    state = json.loads((out / "bench-state.json").read_text())
    assert state["calls"][-1]["rc"] == 2 and state["units"] == {}


def test_a_pretraining_stopped_by_its_safety_cap_is_reported_as_a_cut_recipe(tmp_path: Path) -> None:
    """--pretrain-seconds is a cap, not the recipe: when it stops pretraining, the call says RECIPE CUT and the unit
    is recorded as cut; a later call reusing that target says it again."""
    out = tmp_path / "q"
    empty = tmp_path / "no-gutenberg"
    empty.mkdir()
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--stage", "target", "--gutenberg", str(empty),
           "--pretrain-seconds", "0.5"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "target" / "pretrain.json").read_text())
    assert summary["steps_done"] < summary["settings"]["steps"] == 40
    assert f"RECIPE CUT: target seed 0 pretrained {summary['steps_done']}/40 steps" in r.stdout
    unit = json.loads((out / "bench-state.json").read_text())["units"]["pretrain/seed0"]
    assert unit["cut"] is True and unit["steps"] == summary["steps_done"]
    again = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "RECIPE CUT" in again.stdout and "(reused)" in again.stdout
    assert json.loads((out / "target" / "pretrain.json").read_text()) == summary  # reused, not pretrained again
