"""Tests of the `dflash` CLI as a user runs it: bad input exits 2 with one line, signals end a run cleanly.

Subprocess tests run the real `python -m dflash` entry point (what `opsctl launch local tiny` starts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from dflash_fixtures import tiny_run_yaml

from dflash.cli import main
from dflash.telemetry import read_events

REPO = Path(__file__).resolve().parents[1]


def _write(tmp: Path, cfg: dict, name: str = "run.yaml") -> Path:
    p = tmp / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def _merge(base: dict, patch: dict) -> dict:
    """Deep merge, so a patch of target.arch changes one key of the tiny arch instead of replacing it."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def _field_line(text: str, field: str) -> int:
    """1-based line of a dotted field path (`a.b[0]`) in block-style YAML, found by indentation alone."""
    parts = field.replace("[", ".").replace("]", "").split(".")
    lines = text.splitlines()
    i, indent = 0, 0
    for part in parts:
        if part.isdigit():  # a list item: safe_dump writes `- ` at its key's indent
            items = [j for j in range(i, len(lines)) if lines[j].startswith(" " * (indent - 2) + "- ")]
            i = items[int(part)]
            continue
        i = next(j for j in range(i, len(lines)) if lines[j].startswith(" " * indent + part + ":"))
        indent += 2
    return i + 1


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize(("patch", "expected"), [
    ({"train": {"lr": "fast"}}, "train.lr: expected a number, got 'fast'"),
    ({"train": {"learning_rate": 1e-3}}, "train.learning_rate: unknown field"),
    ({"drafter": {"block_size": 2.5}}, "drafter.block_size: expected an integer, got 2.5"),
    ({"data": {"format": "csv"}}, "data.format: expected one of auto, text, chat, sharegpt, got 'csv'"),
    ({"target": {"tap_layers": ["x"]}}, "target.tap_layers[0]: expected an integer, got 'x'"),
    ({"data": {"token_budget": 4}}, "data.token_budget: must be at least data.max_len (48), got 4"),
    ({"bogus": {}}, "bogus: unknown field"),
    # semantics: found at load (or, for what needs the target's shape or the device, before --out is touched)
    ({"drafter": {"num_anchors": 0}}, "drafter.num_anchors: must be in 1..data.token_budget (256), got 0"),
    ({"drafter": {"num_anchors": 5000}}, "drafter.num_anchors: must be in 1..data.token_budget (256), got 5000"),
    ({"drafter": {"num_layers": 0}}, "drafter.num_layers: must be >= 1, got 0"),
    ({"drafter": {"num_heads": 3, "num_kv_heads": 2}},
     "drafter.num_heads: must be a multiple of drafter.num_kv_heads (2), got 3"),
    ({"drafter": {"num_kv_heads": 0}}, "drafter.num_kv_heads: must be >= 1, got 0"),
    ({"drafter": {"block_size": 0}}, "drafter.block_size: must be >= 2, got 0"),
    ({"drafter": {"loss_gamma": 0}}, "drafter.loss_gamma: must be > 0, got 0.0"),
    ({"drafter": {"loss_gamma": -1}}, "drafter.loss_gamma: must be > 0, got -1.0"),
    ({"drafter": {"mask_token_id": 99999}}, "drafter.mask_token_id: must be < the target's embedding rows (512, the "
                                            "tiny tokenizer's data.vocab_size), got 99999"),
    ({"drafter": {"attention": "flex-eager"}}, "drafter.attention: flex-eager needs a CUDA device"),
    ({"drafter": {"attention": "flex"}}, "drafter.attention: flex needs a CUDA device"),
    ({"drafter": {"attention": "fast"}}, "drafter.attention: expected one of auto, flex, dense, flex-eager"),
    ({"drafter": {"hidden_size": 48}}, "drafter.hidden_size: must equal the target hidden size 32"),
    ({"data": {"min_len": 500}}, "data.min_len: must be in 1..data.max_len (48), got 500"),
    ({"target": {"arch": {"bogus_key": 1}}}, "target.arch.bogus_key: unknown Qwen3_5TextConfig field"),
    ({"target": {"arch": {"num_hidden_layers": 0}}}, "target.arch.num_hidden_layers: must be an integer >= 1, got 0"),
    ({"target": {"tap_layers": [9]}}, "target.tap_layers: layer 9 is outside 0..3"),
    ({"target": {"family": "llama"}}, "target.family: expected one of qwen3_5, qwen3, got 'llama'"),
    ({"target": {"arch": {"layer_types": ["full_attention"]}}},
     "target.arch.layer_types: has 1 entries for target.arch.num_hidden_layers=4"),
    ({"target": {"path": "/nonexistent/model"}}, "target.path: /nonexistent/model does not exist"),
    # a hybrid target of linear layers alone crashed inside transformers at the first cached decode (held-out set)
    ({"target": {"arch": {"num_hidden_layers": 2}, "tap_layers": [0, 1]}},
     "target.arch.num_hidden_layers: 2 layers of the qwen3_5 pattern"),
    ({"target": {"arch": {"layer_types": ["linear_attention"] * 4}}},
     "target.arch.layer_types: needs at least one full_attention layer"),
    ({"dist": {"timeout_s": 0}}, "dist.timeout_s: must be at least 1, got 0.0"),
])
def test_bad_config_exits_2_naming_file_and_field_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], patch: dict, expected: str) -> None:
    if "attention" in patch.get("drafter", {}) and "flex" in patch["drafter"]["attention"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("flex attention is refused on CPU runs only")
    cfg = _merge(tiny_run_yaml(), patch)
    path = _write(tmp_path, cfg)
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--out", str(out)]) == 2
    line = _field_line(path.read_text(), expected.split(": ")[0])
    assert _one_line_error(capsys).startswith(f"dflash: {path}:{line}: {expected}")
    assert not out.exists()


@pytest.mark.parametrize(("text", "line", "what"), [
    ("train:\n  lr: [1,\n", 2, "not valid YAML: expected the node content, but found '<stream end>'"),
    ("train:\n  lr: [1,\n  seed: 2\ndata:\n  max_len: 3\n", 2, "(a '[' list opened on this line is not closed)"),
    ("train:\n  lr 3\n  seed: 1\n", 2, "not valid YAML: mapping values are not allowed here"),
    ("train:\n  lr: 'abc\n  seed: 1\n", 2, "(a quoted string opened on this line is not closed)"),
    ("train:\n  lr: 1\n seed: 2\n", 3, "not valid YAML: expected <block end>"),
    ("train:\n  lr: 1\n  lr: 2\n", 3, "train.lr: duplicate key"),
])
def test_yaml_syntax_errors_name_the_line_to_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                                line: int, what: str) -> None:
    p = tmp_path / "broken.yaml"
    p.write_text(text)
    assert main(["train", "--config", str(p), "--out", str(tmp_path / "o")]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"dflash: {p}:{line}: ") and what in err
    assert not (tmp_path / "o").exists()


def test_config_that_is_not_utf8_exits_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "latin1.yaml"
    p.write_bytes("# caf\u00e9 config\ntrain:\n  lr: 0.01\n".encode("latin-1"))
    assert main(["train", "--config", str(p), "--out", str(tmp_path / "o")]) == 2
    assert _one_line_error(capsys) == (f"dflash: {p}:1: not UTF-8 text (byte 0xe9 at offset 5); save the file as "
                                       "UTF-8")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text", ["", "# nothing here yet\n", "{}\n"])
def test_empty_config_is_refused_pointing_at_a_complete_one(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            text: str) -> None:
    p = tmp_path / "empty.yaml"
    p.write_text(text)
    assert main(["train", "--config", str(p), "--out", str(tmp_path / "o")]) == 2
    assert _one_line_error(capsys) == f"dflash: {p}: empty config (see configs/tiny.yaml for a complete one)"
    assert not (tmp_path / "o").exists()


def test_exponent_numbers_without_a_dot_are_numbers(tmp_path: Path) -> None:
    """YAML 1.1 reads `3e-4` and `1e6` as strings; every ML config writes a learning rate that way."""
    from dflash.config import load_config

    text = yaml.safe_dump(tiny_run_yaml()).replace("lr: 0.01", "lr: 3e-4").replace("max_chars: 200000",
                                                                                  "max_chars: 2e5")
    p = tmp_path / "run.yaml"
    p.write_text(text + "  weight_decay: 1E-2\n")
    cfg = load_config(p)
    assert (cfg.train.lr, cfg.data.max_chars, cfg.train.weight_decay) == (3e-4, 200000, 0.01)
    assert isinstance(cfg.data.max_chars, int)
    p.write_text(text.replace("max_chars: 2e5", "max_chars: 2.5e0"))
    with pytest.raises(ValueError, match=r"data.max_chars: expected an integer, got 2.5"):
        load_config(p)


def test_bad_yaml_and_missing_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "broken.yaml"
    p.write_text("train:\n  lr: [1,\n")
    assert main(["train", "--config", str(p), "--out", str(tmp_path / "o")]) == 2
    assert f"{p}:2: not valid YAML" in _one_line_error(capsys)
    assert main(["train", "--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "cannot read config" in _one_line_error(capsys)
    assert not (tmp_path / "o").exists()


def test_bad_data_exits_2_naming_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": "oops"}\n')
    path = _write(tmp_path, tiny_run_yaml(data={"paths": [str(data)]}))
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--out", str(out)]) == 2
    assert _one_line_error(capsys) == f"dflash: {data}:2: 'messages' must be a non-empty list"
    assert not out.exists()


def test_resume_on_corrupt_checkpoint_is_refused_naming_the_file_and_ends_at_its_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, tiny_run_yaml(train={"max_steps": 2, "checkpoint_every": 1, "keep_last": 3}))
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--out", str(out)]) == 0
    bad = out / "checkpoints" / "step-2" / "optimizer.pt"
    bad.write_bytes(bad.read_bytes()[:-10])  # truncated
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--out", str(out), "--resume", "--max-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: size" in err and "refusing to resume" in err and "step-1" in err
    evs = list(read_events(out / "events.jsonl"))
    assert evs[-1]["kind"] == "run_end" and evs[-1]["exit_code"] == 2
    # the run stands at its newest checkpoint (step 2), refused; not `error at step 0`
    assert (evs[-1]["reason"], evs[-1]["step"]) == ("refused", 2)
    assert [e["class"] for e in evs if e["kind"] == "error"] == ["config"]


def test_help_teaches_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "dflash train --config configs/tiny.yaml --out runs/tiny" in text and "--resume" in text
    assert "exit codes" in text


def test_preflight_of_a_full_attention_qwen3_target_binds_no_linear_attention_op(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _merge(tiny_run_yaml(), {"target": {"family": "qwen3", "arch": {
        "linear_num_key_heads": None, "linear_num_value_heads": None}}}))
    cfg = yaml.safe_load(path.read_text())
    for key in ("linear_num_key_heads", "linear_num_value_heads"):  # not Qwen3Config fields
        del cfg["target"]["arch"][key]
    path.write_text(yaml.safe_dump(cfg))
    assert main(["preflight", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "chunk_gated_delta_rule" in out and "absent" in out and "preflight: ok" in out


def test_preflight_on_cpu_lists_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preflight", "--config", str(REPO / "configs" / "tiny.yaml")]) == 0
    out = capsys.readouterr().out
    assert "chunk_gated_delta_rule" in out and "torch-fallback" in out and "preflight: ok" in out


def _start(tmp_path: Path, own_tokenizer: bool = False, **train: object) -> tuple[subprocess.Popen[bytes], Path]:
    cfg = tiny_run_yaml(train={"checkpoint_every": 0, "heartbeat_s": 0.2, **train})
    if own_tokenizer:  # trained in OUT/tokenizer: preparing_data then lasts a couple of seconds
        cfg["data"]["tokenizer_cache"] = None
    path = _write(tmp_path, cfg)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(path), "--out", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, out


def _wait_for(out: Path, kind: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "events.jsonl").exists() and any(e["kind"] == kind for e in read_events(out / "events.jsonl")):
            return
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event within {timeout}s")


def test_sigterm_finishes_step_checkpoints_and_exits_0(tmp_path: Path) -> None:
    proc, out = _start(tmp_path, max_steps=100000)
    try:
        _wait_for(out, "step", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    evs = list(read_events(out / "events.jsonl"))
    end = evs[-1]
    assert (end["kind"], end["reason"], end["exit_code"], end["signal"]) == ("run_end", "signal", 0, "SIGTERM")
    ckpt = [e for e in evs if e["kind"] == "checkpoint"]
    assert ckpt and ckpt[-1]["step"] == end["step"] and Path(ckpt[-1]["path"]).is_dir()
    assert json.loads((out / "run.json").read_text())["run_id"] == end["run_id"]


def _popen(path: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(path), "--out", str(out),
                             *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_signal_before_the_first_step_stops_at_the_phase_boundary_without_loading(tmp_path: Path) -> None:
    """With a 27B target, loading and a first step take minutes: a first SIGTERM during data preparation must end
    the run at the next phase boundary (no target load, no step, no checkpoint), reason signal, exit 0."""
    # No shared tokenizer cache: the BPE is trained and the corpus tokenized in preparing_data (~2 s here).
    cfg = tiny_run_yaml(train={"max_steps": 2, "checkpoint_every": 0, "heartbeat_s": 0.2})
    cfg["data"]["tokenizer_cache"] = None
    path = _write(tmp_path, cfg)
    out = tmp_path / "out"
    n_events = n_heartbeats = 0
    for resumed in (False, True):
        proc = _popen(path, out, *(["--resume", "--max-steps", "4"] if resumed else []))
        try:
            if resumed:  # the earlier runs' heartbeats are in the file: wait for this run's first
                while (out / "events.jsonl").read_bytes().count(b'"heartbeat"') <= n_heartbeats:
                    assert proc.poll() is None
                    time.sleep(0.02)
            else:
                _wait_for(out, "heartbeat", proc)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        evs = list(read_events(out / "events.jsonl"))
        if resumed:
            evs = evs[n_events:]
        end = evs[-1]
        assert (end["kind"], end["reason"], end["exit_code"], end["signal"]) == ("run_end", "signal", 0, "SIGTERM")
        assert end["step"] == (2 if resumed else 0)
        assert [e["phase"] for e in evs if e["kind"] == "heartbeat"][0] == "preparing_data"
        assert not [e for e in evs if e["kind"] in ("step", "checkpoint", "phase", "run_start", "error")]
        assert [p.name for p in (out / "checkpoints").glob("step-*")] == ([] if not resumed else ["step-2"])
        if not resumed:  # now a run with a checkpoint to resume from
            assert main(["train", "--config", str(path), "--out", str(out), "--fresh"]) == 0
            n_events = len((out / "events.jsonl").read_bytes().splitlines())
            n_heartbeats = (out / "events.jsonl").read_bytes().count(b'"heartbeat"')


def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    proc, out = _start(tmp_path, own_tokenizer=True, max_steps=100000)
    try:
        _wait_for(out, "heartbeat", proc)
        # handlers are installed before the first heartbeat; data preparation still takes seconds, and the first
        # signal alone would end the run at the end of it
        proc.send_signal(signal.SIGINT)
        # Signals that arrive while the main thread is inside native code (the tokenizer's BPE training) reach
        # Python's handler as one: keep signalling until one lands after the first handler ran, which is the second
        # (a single 0.2 s-later signal merged with the first under load: exit 0, 2026-12-07 under xdist).
        deadline = time.time() + 30
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step-*"))


def test_shipped_tiny_config_loads_and_yaml_booleans_map_to_choices(tmp_path: Path) -> None:
    from dflash.config import load_config

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert cfg.target.path is None and cfg.target.arch["num_hidden_layers"] == 6
    assert cfg.data.paths == [] and cfg.dist.roles == "colocated" and cfg.train.max_steps is not None
    p = _write(tmp_path, tiny_run_yaml(train={"compile": False}))
    assert load_config(p).train.compile == "false"


def test_semantic_config_error_found_at_load_exits_2_naming_the_field(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A tap layer outside the target is known from the arch alone: refused before --out is created."""
    path = _write(tmp_path, tiny_run_yaml(target={"tap_layers": [9]}))
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    line = _field_line(path.read_text(), "target.tap_layers")
    assert _one_line_error(capsys) == f"dflash: {path}:{line}: target.tap_layers: layer 9 is outside 0..3"
    assert not (tmp_path / "out").exists()


def test_preflight_refuses_a_missing_target_path_in_one_line(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, tiny_run_yaml(target={"path": str(tmp_path / "no-model")}))
    assert main(["preflight", "--config", str(path)]) == 2
    line = _field_line(path.read_text(), "target.path")
    assert _one_line_error(capsys) == (f"dflash: {path}:{line}: target.path: {tmp_path / 'no-model'} does not exist "
                                       "(a local Hugging Face model directory)")


@pytest.mark.parametrize("bad", [{"drafter": {"block_size": 0}}, {"target": {"tap_layers": [9]}},
                                 {"drafter": {"hidden_size": 48}}])
def test_fresh_with_a_bad_config_deletes_no_checkpoint_and_keeps_the_events(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: dict) -> None:
    """--fresh is destructive: it may only act once the whole config (target/drafter shapes too) is known good."""
    good = _write(tmp_path, tiny_run_yaml(train={"max_steps": 2, "checkpoint_every": 1}), "good.yaml")
    out = tmp_path / "out"
    assert main(["train", "--config", str(good), "--out", str(out)]) == 0
    before = {p.name for p in (out / "checkpoints").iterdir()}
    events = (out / "events.jsonl").read_bytes()
    path = _write(tmp_path, _merge(tiny_run_yaml(), bad), "bad.yaml")
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--out", str(out), "--fresh"]) == 2
    line = _field_line(path.read_text(), next(iter(bad)) + "." + next(iter(next(iter(bad.values())))))
    assert _one_line_error(capsys).startswith(f"dflash: {path}:{line}: ")
    assert before == {"step-1", "step-2"} and {p.name for p in (out / "checkpoints").iterdir()} == before
    assert (out / "events.jsonl").read_bytes() == events


def test_fresh_and_resume_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, tiny_run_yaml(train={"max_steps": 2, "checkpoint_every": 0}))
    out = tmp_path / "out"
    args = ["train", "--config", str(path), "--out", str(out)]
    assert main([*args, "--resume", "auto"]) == 0  # nothing to resume: starts
    assert main(args) == 2 and "--fresh" in capsys.readouterr().err
    assert main([*args, "--resume", "auto", "--max-steps", "3"]) == 0  # resumes 2 -> 3
    starts = [e for e in read_events(out / "events.jsonl") if e["kind"] == "run_start"]
    assert [s["resumed_from"] for s in starts] == [None, 2]
    assert main([*args, "--fresh"]) == 0
    starts = [e for e in read_events(out / "events.jsonl") if e["kind"] == "run_start"]
    assert [s["resumed_from"] for s in starts] == [None]  # a fresh run truncates the events
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]


def test_mask_token_outside_a_tokenizer_directory_vocab_exits_2_writing_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The vocabulary of a real tokenizer directory is known only once it is loaded: still before --out is touched."""
    from dflash_fixtures import tiny_corpus
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    _, tok, _ = tiny_corpus()
    hf = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(tok.source), eos_token="<|endoftext|>",
                            pad_token="<|pad|>").save_pretrained(hf)
    path = _write(tmp_path, tiny_run_yaml(data={"tokenizer": str(hf)}, drafter={"mask_token_id": 600}))
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--out", str(out)]) == 2
    line = _field_line(path.read_text(), "drafter.mask_token_id")
    assert _one_line_error(capsys) == (f"dflash: {path}:{line}: drafter.mask_token_id: must be < the target's "
                                       f"embedding rows ({tok.vocab_size}, the tokenizer's vocabulary), got 600")
    assert not out.exists()


def test_mask_token_id_is_bounded_by_the_target_embedding_not_the_tokenizer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real targets reserve the mask id past the tokenizer's last token: the embedding's rows are the bound."""
    cfg = tiny_run_yaml(train={"max_steps": 1, "checkpoint_every": 0})
    cfg["target"]["arch"]["vocab_size"] = 600  # the tiny tokenizer has 512 tokens
    ok = _write(tmp_path, _merge(cfg, {"drafter": {"mask_token_id": 550}}), "ok.yaml")
    assert main(["train", "--config", str(ok), "--out", str(tmp_path / "ok")]) == 0
    meta = json.loads((tmp_path / "ok" / "checkpoints" / "step-1" / "meta.json").read_text())
    assert meta["drafter"]["mask_token_id"] == 550 and meta["target"]["vocab_size"] == 600
    bad = _write(tmp_path, _merge(cfg, {"drafter": {"mask_token_id": 600}}), "bad.yaml")
    capsys.readouterr()
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "bad")]) == 2
    line = _field_line(bad.read_text(), "drafter.mask_token_id")
    assert _one_line_error(capsys) == (f"dflash: {bad}:{line}: drafter.mask_token_id: must be < the target's "
                                       "embedding rows (600, target.arch.vocab_size), got 600")
    assert not (tmp_path / "bad").exists()


def test_a_section_with_every_key_commented_out_takes_its_defaults(tmp_path: Path) -> None:
    from dflash.config import load_config

    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(tiny_run_yaml()) + "dist:\n  # roles: split\n")
    cfg = load_config(p)
    assert (cfg.dist.roles, cfg.dist.target_ranks, cfg.train.max_steps) == ("colocated", None, 6)


@pytest.mark.parametrize("cmd", [["train"], ["eval"], ["export"], ["data", "inspect"]])
def test_every_main_command_help_teaches_with_examples_and_exit_codes(
        cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*cmd, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "exit codes:" in out and f"dflash {' '.join(cmd)} " in out.split("examples:")[1]
    description = out.split("\n\n")[1]  # the paragraph under usage, wrapped to the terminal's reading width
    assert len(description) > 80 and max(len(line) for line in description.splitlines()) <= 100
