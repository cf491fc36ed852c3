"""One road into training (issue 41): `dflash train` and the train() API run one preflight (dflash/runprep.py) —
the tokenizer loaded once, the run lock taken once, the resume check done once — plus what that preflight now says
or refuses (issue 39 item 5: data notes as warning lines, an evaluation too long for its drafter pass).

Real trainings of the tiny test config (CPU); only counters are wrapped around the real functions.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from dflash_fixtures import run_config, tiny_corpus, tiny_run_yaml


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every tokenizer load, run-lock take and resume-config check of this process, counted."""
    import dflash.data
    import dflash.locks
    import dflash.rundir

    seen: Counter[str] = Counter()
    load, acquire, differences = (dflash.data._load_tokenizer, dflash.locks.acquire,
                                  dflash.rundir.resume_config_differences)

    def counting_load(*a: Any, **k: Any) -> Any:
        seen["tokenizer"] += 1
        return load(*a, **k)

    def counting_acquire(lock_file: Any, *a: Any, **k: Any) -> Any:
        if Path(lock_file).name == dflash.locks.RUN_LOCK:
            seen["run_lock"] += 1
        return acquire(lock_file, *a, **k)

    def counting_differences(*a: Any, **k: Any) -> Any:
        seen["resume_check"] += 1
        return differences(*a, **k)

    monkeypatch.setattr(dflash.data, "_load_tokenizer", counting_load)
    monkeypatch.setattr(dflash.locks, "acquire", counting_acquire)
    monkeypatch.setattr(dflash.rundir, "resume_config_differences", counting_differences)
    return seen


def _hf_tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    _, tok, _ = tiny_corpus()
    hf = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(tok.source), eos_token="<|endoftext|>",
                            pad_token="<|pad|>").save_pretrained(hf)
    return hf


def _config(tmp_path: Path, **sections: dict[str, Any]) -> Path:
    p = tmp_path / "run.yaml"
    cfg = tiny_run_yaml(**{"train": {"max_steps": 1, "checkpoint_every": 0, "eval_every": 0}, **sections})
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_dflash_train_loads_the_tokenizer_and_takes_the_lock_once(tmp_path: Path, counts: Counter[str]) -> None:
    """A tokenizer directory (its size checked against the target before OUT is touched): the CLI, train() and the
    Trainer each loaded it and the lock was taken twice; one road does each once, and a resume checks its config
    once."""
    from dflash.cli import main

    hf = _hf_tokenizer(tmp_path)
    arch = {**tiny_run_yaml()["target"]["arch"], "vocab_size": 600}
    cfg = _config(tmp_path, data={"tokenizer": str(hf)}, drafter={"mask_token_id": 550},
                  target={"arch": arch, "seed": 0})
    out = tmp_path / "out"
    counts.clear()  # the fixture's own tokenizer
    assert main(["train", "--config", str(cfg), "--out", str(out)]) == 0
    assert counts == {"tokenizer": 1, "run_lock": 1}
    counts.clear()
    assert main(["train", "--config", str(cfg), "--out", str(out), "--resume", "--max-steps", "2"]) == 0
    assert counts == {"tokenizer": 1, "run_lock": 1, "resume_check": 1}
    counts.clear()
    assert main(["train", "--config", str(cfg), "--out", str(out), "--resume", "auto", "--max-steps", "3"]) == 0
    assert counts == {"tokenizer": 1, "run_lock": 1, "resume_check": 1}


def test_the_api_and_init_from_take_the_same_road(tmp_path: Path, counts: Counter[str]) -> None:
    """train() called directly: one load, one lock. `--init-from` reads the mask token from the run's (cached)
    tokenizer, which the Trainer then uses: still one load (it was the check's own load plus the Trainer's)."""
    from dflash.cli import main
    from dflash.train import train

    assert train(run_config(train={"max_steps": 1, "checkpoint_every": 0, "eval_every": 0}),
                 tmp_path / "api").exit_code == 0
    assert counts == {"tokenizer": 1, "run_lock": 1}
    counts.clear()
    from dflash.cli import main as cli_main

    assert cli_main(["export", "--checkpoint", str(tmp_path / "api" / "checkpoints" / "step-1"), "--out",
                     str(tmp_path / "exp")]) == 0
    counts.clear()
    assert main(["train", "--config", str(_config(tmp_path)), "--out", str(tmp_path / "b"), "--init-from",
                 str(tmp_path / "exp")]) == 0
    assert counts == {"tokenizer": 1, "run_lock": 1}
    assert "drafter initialised from" in (tmp_path / "b" / "train.log").read_text()


def test_a_refusal_after_the_lock_leaves_no_directory_and_the_lock_free(tmp_path: Path) -> None:
    """check_out refuses (checkpoints, no --resume) after the lock: the lock is given back, so the next start runs."""
    from dflash import locks
    from dflash.rundir import UsageError
    from dflash.train import train

    cfg = run_config(train={"max_steps": 1, "checkpoint_every": 0, "eval_every": 0})
    assert train(cfg, tmp_path / "a").exit_code == 0
    with pytest.raises(UsageError, match="has checkpoints"):
        train(cfg, tmp_path / "a")
    assert locks._HELD == {}
    assert train(cfg, tmp_path / "a", resume=True, max_steps=2).exit_code == 0


def test_training_says_an_empty_data_file_and_a_file_read_twice(tmp_path: Path) -> None:
    from dflash.train import train

    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 8}) + "\n"
                                       for i in range(40)))
    (d / "empty.jsonl").write_text("")
    cfg = run_config(data={"paths": [str(d), str(d / "a.jsonl")], "min_len": 4},
                     train={"max_steps": 1, "checkpoint_every": 0, "eval_every": 0})
    assert train(cfg, tmp_path / "run").exit_code == 0
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"data: warning: {d / 'empty.jsonl'}: no record in it (an empty file): nothing read from it" in log
    assert f"data: warning: {(d / 'a.jsonl').resolve()}: read 2 times" in log


def test_an_eval_too_long_for_its_drafter_pass_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main
    from dflash.measure import max_eval_tokens

    limit = max_eval_tokens(4)
    cfg = _config(tmp_path, train={"max_steps": 1, "checkpoint_every": 1, "eval_new_tokens": limit,
                                   "eval_prompt_tokens": 8})
    out = tmp_path / "out"
    assert main(["train", "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.eval_new_tokens: held-out sequences of 8 prompt" in err[0]
    assert f"exceed the {limit} the evaluation's drafter pass can chunk at block size 4" in err[0]
    assert not out.exists()
    ok = _config(tmp_path, train={"max_steps": 1, "checkpoint_every": 1, "eval_new_tokens": 16})
    assert main(["train", "--config", str(ok), "--out", str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "ok" / "checkpoints" / "step-1"), "--max-new-tokens",
                 str(limit)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"dflash eval: --max-new-tokens {limit}: prompt + new tokens + B-1") and "chunk" in line
