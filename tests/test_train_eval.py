"""tau live in every run: `eval` events at the checkpoints, from a cached held-out set, equal to `dflash eval`.

Real trainings of the tiny test config (CPU, float32); the held-out set is cached under $DFLASH_CACHE.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash_fixtures import run_config

from dflash.telemetry import read_events
from dflash.train import train


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE", str(d))
    return d


def _events(out: Path, kind: str) -> list[dict]:
    return [e for e in read_events(out / "events.jsonl") if e["kind"] == kind]


def test_eval_events_at_every_checkpoint_equal_dflash_eval_of_that_checkpoint(
        tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main

    out = tmp_path / "run"
    cfg = run_config(drafter={"block_size": 8, "sliding_window": 16}, train={"max_steps": 8, "checkpoint_every": 4})
    assert train(cfg, out).exit_code == 0
    evals = _events(out, "eval")
    assert [e["step"] for e in evals] == [4, 8]  # the periodic one and the final one
    phases = [e["phase"] for e in _events(out, "phase")]
    assert phases.count("evaluating") == 2 and phases.index("evaluating") > phases.index("training")
    last = evals[-1]
    assert last["sequences"] == 32 and last["block_size"] == 8 and len(last["accept_by_position"]) == 7
    assert last["tokens"] == 32 * 36  # 48-token pieces: 12-token prompts, 36 new tokens each (no stop reached)
    assert last["tau"] == pytest.approx(1 + sum(last["accept_by_position"]), abs=1e-3)
    assert sum(last["accept_hist"]) > 0 and last["ngram_tau"] >= 1.0
    # `dflash eval` on the same checkpoint with the same prompt settings measures exactly the same.
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out / "checkpoints" / "step-8"), "--json", "--baseline", "ngram",
                 "--num-prompts", "32", "--prompt-tokens", "12", "--max-new-tokens", "36"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tau"] == last["tau"] and res["accept_by_position"] == last["accept_by_position"]
    assert res["baseline"]["ngram"]["tau"] == last["ngram_tau"] and res["accept_hist"] == last["accept_hist"]
    assert list(res["tau_ci95"]) == last["tau_ci95"]
    assert len(list(cache.glob("heldout-*/taps.pt"))) == 1


def test_the_heldout_set_is_made_with_the_training_target_no_second_instance(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: a run's first evaluation made its held-out set with a second target instance, loaded before the
    training one (at 27B a second full load of the weights). One Target per run, cold cache or warm."""
    import dflash.target

    built: list[str] = []
    init = dflash.target.Target.__init__

    def counting_init(self: dflash.target.Target, *a: object, **k: object) -> None:
        built.append("target")
        init(self, *a, **k)

    monkeypatch.setattr(dflash.target.Target, "__init__", counting_init)
    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 0, "eval_every": 2})
    assert train(cfg, tmp_path / "a").exit_code == 0
    assert len(built) == 1 and len(list(cache.glob("heldout-*/taps.pt"))) == 1
    log = (tmp_path / "a" / "train.log").read_text()
    assert "making the held-out set" in log and "with the training target" in log
    # made after the target's load, before the drafter is built
    assert log.index("target: ") < log.index("making the held-out set") < log.index("drafter: ")
    assert train(cfg, tmp_path / "b").exit_code == 0  # the cached set: still one target
    assert len(built) == 2
    assert [e["tau"] for e in _events(tmp_path / "a", "eval")] == [e["tau"] for e in _events(tmp_path / "b", "eval")]


def test_decoding_attention_puts_the_training_attention_back() -> None:
    """The held-out set decodes with the training target on sdpa; a target that trains with the packed-row varlen
    function must get it back, or every training forward would run with a dense mask."""
    from dflash.target import Target, decoding_attention, register_varlen_attention

    cfg = run_config()
    t = Target(cfg.target, 1, torch.device("cpu"), vocab=64)
    name = register_varlen_attention()
    t.model.set_attn_implementation(name)
    with decoding_attention(t.model):
        assert t.model.config._attn_implementation == "sdpa"
    assert t.model.config._attn_implementation == name
    t.model.set_attn_implementation("sdpa")
    with decoding_attention(t.model):
        pass
    assert t.model.config._attn_implementation == "sdpa"


def test_eval_every_zero_turns_evaluation_off(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "run"
    assert train(run_config(train={"max_steps": 4, "checkpoint_every": 2, "eval_every": 0}), out).exit_code == 0
    assert _events(out, "eval") == [] and not cache.exists()


def test_a_corrupt_heldout_cache_is_rebuilt_and_says_so(tmp_path: Path, cache: Path) -> None:
    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 0, "eval_every": 2})
    assert train(cfg, tmp_path / "a").exit_code == 0
    (taps,) = cache.glob("heldout-*/taps.pt")
    first = _events(tmp_path / "a", "eval")
    taps.write_bytes(taps.read_bytes()[:100])  # cut, as a full disk or a killed copy leaves it
    assert train(cfg, tmp_path / "b").exit_code == 0
    log = (tmp_path / "b" / "train.log").read_text()
    assert f"the cached held-out set {taps.parent} does not verify" in log and "rebuilding it" in log
    second = _events(tmp_path / "b", "eval")
    assert [e["tau"] for e in second] == [e["tau"] for e in first] and taps.stat().st_size > 100


def test_a_corpus_with_nothing_held_out_trains_without_eval_and_says_why(tmp_path: Path, cache: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": f"def f(x):\n    return x + {i}\n" * 8}) + "\n"
                                          for i in range(40)))
    cfg = run_config(data={"paths": [str(data)], "min_len": 4}, train={"max_steps": 16, "checkpoint_every": 8})
    assert train(cfg, tmp_path / "run").exit_code == 0
    assert _events(tmp_path / "run", "eval") == []
    assert "eval: off for this run: no held-out documents" in (tmp_path / "run" / "train.log").read_text()


def test_a_cached_heldout_set_of_configured_data_is_found_without_scheduling_the_corpus_again(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding configured data's held-out documents tokenizes the whole corpus and builds its schedule: a week-long
    run's restarts must not pay that again once the set is cached (its key is what decides the prompts)."""
    import dflash.measure

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 6})
                                          + "\n" for i in range(60)))
    cfg = run_config(data={"paths": [str(data)], "min_len": 4}, train={"max_steps": 2, "checkpoint_every": 0,
                                                                         "eval_every": 2})
    assert train(cfg, tmp_path / "a").exit_code == 0
    first = _events(tmp_path / "a", "eval")
    assert len(first) == 1

    def schedule_again(*_a: object, **_k: object) -> None:
        raise AssertionError("the held-out documents were looked up again")

    monkeypatch.setattr(dflash.measure, "heldout_documents_of", schedule_again)
    assert train(cfg, tmp_path / "b").exit_code == 0
    second = _events(tmp_path / "b", "eval")
    assert [(e["tau"], e["ngram_tau"], e["sequences"]) for e in second] == \
        [(e["tau"], e["ngram_tau"], e["sequences"]) for e in first]
    assert "making the held-out set" not in (tmp_path / "b" / "train.log").read_text()
