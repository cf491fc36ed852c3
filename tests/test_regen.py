"""Tests of `dflash regen`: the target's own continuations become training records (ids kept, generated tokens
supervised), the run survives a real kill without losing or repeating a prompt, `dflash train` reads the records
against the target that wrote them, and a drafter trained on them is accepted more often than one trained on the raw
corpus for the same number of steps.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_pretrain import pretrained_target_cfg, pretrained_yaml

from dflash.cli import main
from dflash.config import config_from_dict
from dflash.data import DataError, load_tokenizer, read_documents, tokenize
from dflash.pretrain import replace_fields, resolve_target
from dflash.regen import CUDA_GRID_Y_MAX, RECORDS, Prompt, RegenSettings, corpus_prompts, cuda_rows_cap, regen, spread

REPO = Path(__file__).resolve().parent.parent
SETTINGS = RegenSettings(num_prompts=256, prompt_tokens=12, max_new_tokens=36, batch_size=128)


@pytest.fixture(scope="module")
def resolved() -> Any:
    return pretrained_target_cfg()


@pytest.fixture(scope="module")
def regen_dir(resolved: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("regen") / "data"
    regen(resolved, read_documents(resolved.data), out, SETTINGS, log=lambda _m: None)
    return out


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (path / RECORDS).read_text().splitlines()]


def test_spread_takes_evenly_spaced_prompts_in_corpus_order() -> None:
    ps = [Prompt(f"{i}:0", [i]) for i in range(10)]
    assert [p.id for p in spread(ps, 3)] == ["0:0", "3:0", "6:0"]
    assert [p.id for p in spread(ps, 4)] == ["0:0", "2:0", "5:0", "7:0"]
    assert spread(ps, 10) == ps and spread(ps, 50) == ps and spread(ps, 1) == ps[:1]


def _plain_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """The target's greedy continuation the slow way: the whole sequence through the model at every step, no cache."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_records_keep_ids_supervise_only_generated_tokens_and_are_the_targets_greedy(resolved: Any,
                                                                                     regen_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    docs = read_documents(resolved.data)
    tok = load_tokenizer(resolved.data, docs, resolved.data.tokenizer_cache)
    recs = _records(regen_dir)
    every = corpus_prompts(docs, tok, 12, resolved.data.max_len)
    want = spread(every, 256)
    assert [r["id"] for r in recs] and sorted(r["id"] for r in recs) == sorted(p.id for p in want)
    # The cap spreads over the corpus: the records reach its last documents, not just the first 256 prompts' files.
    doc_of = [int(p.id.split(":")[0]) for p in every]
    assert len(every) > 256 and max(int(r["id"].split(":")[0]) for r in recs) > max(doc_of[:256])
    by_id = {p.id: p for p in want}
    for r in recs:
        doc, start = (int(x) for x in r["id"].split(":"))
        p = r["prompt_tokens"]
        assert r["input_ids"][:p] == by_id[r["id"]].ids == tok.encode(docs[doc].text)[start:start + p]
        assert r["loss_mask"] == [0] * p + [1] * (len(r["input_ids"]) - p)
        gen = r["input_ids"][p:]
        assert 1 <= len(gen) <= 36 and (r["end"] == "stop") == (gen[-1] in tok.stop_ids())
    model = AutoModelForCausalLM.from_pretrained(resolved.target.path).eval()
    for r in recs[:2]:
        p = r["prompt_tokens"]
        gen = r["input_ids"][p:]
        assert gen == _plain_greedy(model, r["input_ids"][:p], len(gen))
    manifest = json.loads((regen_dir / "regen.json").read_text())
    assert manifest["target"]["path"] == resolved.target.path
    assert manifest["tokenizer"]["content_hash"] == tok.content_hash


def test_train_reads_records_as_ids_with_their_tokenizer_and_target(resolved: Any, regen_dir: Path) -> None:
    y = pretrained_yaml()
    y["data"]["paths"] = [str(regen_dir)]
    cfg = config_from_dict(y, "<t>")
    docs = read_documents(cfg.data)
    assert all(d.ids is not None and d.origin is not None for d in docs)
    tok = load_tokenizer(cfg.data, docs, "/nonexistent")  # pinned: the records' own saved tokenizer, no training
    corpus = tokenize(docs, tok)
    recs = _records(regen_dir)
    assert [t.tolist() for t in corpus.ids] == [r["input_ids"] for r in recs]
    assert [t.tolist() for t in corpus.loss_mask] == [[bool(x) for x in r["loss_mask"]] for r in recs]
    # target.pretrain on regenerated records: the target that wrote them, not a new one trained on them
    said: list[str] = []
    assert resolve_target(cfg, docs, log=said.append).target.path == resolved.target.path
    assert said == [f"target: {resolved.target.path} (the target that regenerated {regen_dir})"]
    # records under another tokenizer than the run's are refused, not silently mis-read
    hf_cfg = replace_fields(cfg.data, tokenizer=resolved.target.path)  # the same vocabulary, wrapped as HF
    with pytest.raises(DataError, match="made with another tokenizer"):
        tokenize(docs, load_tokenizer(hf_cfg, docs, "/nonexistent"))


def test_bad_records_are_refused_naming_file_and_line(tmp_path: Path, regen_dir: Path) -> None:
    y = pretrained_yaml()
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "x.jsonl").write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n")
    y["data"]["paths"] = [str(bare)]
    with pytest.raises(DataError, match=r"x\.jsonl:1: token records need the regen\.json"):
        read_documents(config_from_dict(y, "<t>").data)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "regen.json").write_text((regen_dir / "regen.json").read_text())
    (bad / "r.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n{"input_ids": [1, 2], "loss_mask": [1]}\n')
    y["data"]["paths"] = [str(bad)]
    with pytest.raises(DataError, match=r"r\.jsonl:2: 'loss_mask' must be a list of 0/1"):
        read_documents(config_from_dict(y, "<t>").data)


def _regen_yaml(resolved: Any, tmp_path: Path) -> Path:
    y = pretrained_yaml()
    y["target"] = {"path": resolved.target.path}
    y["data"]["tokenizer_cache"] = resolved.data.tokenizer_cache
    p = tmp_path / "regen.yaml"
    p.write_text(yaml.safe_dump(y))
    return p


def test_a_killed_regen_resumes_without_losing_or_repeating_a_prompt(resolved: Any, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cfg_file, out = _regen_yaml(resolved, tmp_path), tmp_path / "data"
    args = ["regen", "--config", str(cfg_file), "--out", str(out), "--num-prompts", "40", "--batch-size", "2",
            "--prompt-tokens", "12", "--max-new-tokens", "16"]
    proc = subprocess.Popen([sys.executable, "-m", "dflash", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / RECORDS).is_file() and (out / RECORDS).read_text().count("\n") >= 6:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = (out / RECORDS).read_bytes()
    kept = before[: before.rfind(b"\n") + 1]
    assert 6 <= kept.count(b"\n") < 40, "the kill must land mid-run"
    with open(out / RECORDS, "ab") as fh:  # a record torn by the kill: cut off on resume, its prompt redone
        fh.write(b'{"id": "0:0", "input_ids": [5, 6')
    assert main(args) == 0
    after = (out / RECORDS).read_bytes()
    assert after.startswith(kept)  # what was written stays as it was
    ids = [json.loads(line)["id"] for line in after.decode().splitlines()]
    assert len(ids) == len(set(ids)) == 40
    assert "regen: 40 prompts (" in capsys.readouterr().out
    # resuming with other settings would mix two kinds of records: refused
    assert main([*args[:-1], "24"]) == 2
    assert "were made with another settings" in capsys.readouterr().err


def test_a_time_budget_stops_after_a_whole_batch_and_the_next_call_finishes(resolved: Any, tmp_path: Path) -> None:
    docs = read_documents(resolved.data)
    settings = RegenSettings(num_prompts=12, prompt_tokens=12, max_new_tokens=4, batch_size=5)
    first = regen(resolved, docs, tmp_path / "d", settings, log=lambda _m: None, max_seconds=0.0)
    assert first["written"] == 5 and first["complete"] is False  # one whole batch, then the budget stops it
    second = regen(resolved, docs, tmp_path / "d", settings, log=lambda _m: None)
    assert second["written"] == 7 and second["complete"] is True
    ids = [r["id"] for r in _records(tmp_path / "d")]
    assert len(ids) == len(set(ids)) == 12


def test_drafter_trained_on_regenerated_data_is_accepted_more_than_on_the_raw_corpus(
        resolved: Any, regen_dir: Path, tmp_path: Path) -> None:
    from dflash.eval import embedded_heldout, evaluate, load_checkpoint, prompts_from_documents
    from dflash.speculative import TargetLM
    from dflash.target import Target, TargetConfig
    from dflash.train import train

    steps = {"max_steps": 120, "checkpoint_every": 0, "lr": 1e-2, "log_every": 1000}
    runs = {}
    for name, paths in (("raw", []), ("regen", [str(regen_dir)])):
        y = pretrained_yaml()
        y["target"] = {"path": resolved.target.path}
        y["data"].update(paths=paths, tokenizer_cache=resolved.data.tokenizer_cache)
        y["train"].update(steps)
        assert train(config_from_dict(y, f"<{name}>"), tmp_path / name).exit_code == 0
        runs[name] = load_checkpoint(tmp_path / name / "checkpoints" / "step-120")
    docs = read_documents(resolved.data)
    tok = load_tokenizer(resolved.data, docs, resolved.data.tokenizer_cache)
    held = embedded_heldout(resolved.data.max_chars, docs)  # stdlib files past the corpus cap: never trained on
    prompts = prompts_from_documents(held, tok, 12, resolved.data.max_len, 4)
    taus = {}
    for name, loaded in runs.items():
        target = Target(TargetConfig(path=resolved.target.path, tap_layers=loaded.tap_layers), 1,
                        torch.device("cpu"))
        result = evaluate(TargetLM(target.model, loaded.tap_layers), loaded.drafter, prompts, 24, [tok.eos_id],
                          train_acc=False)
        assert result["lossless"]
        taus[name] = result["tau"]
    # measured: raw ~1.1 (the data's tokens are not what this target writes), regen ~2 at B=4
    assert taus["regen"] > taus["raw"] + 0.3, taus


def test_target_regen_builds_the_training_records_once_and_reuses_them(resolved: Any, tmp_path: Path) -> None:
    from dflash.regen import regenerated_documents

    y = pretrained_yaml()
    y["target"]["regen"] = {"num_prompts": 16, "prompt_tokens": 12, "max_new_tokens": 8,
                            "cache_dir": str(tmp_path / "cache")}
    raw = read_documents(resolved.data)
    cfg = resolve_target(config_from_dict(y, "<t>"), raw, log=lambda _m: None)
    said: list[str] = []
    docs = regenerated_documents(cfg, raw, log=said.append)
    assert len(docs) == 16 and all(d.ids is not None and sum(d.mask or []) >= 1 for d in docs)
    assert said[0].startswith("data: regenerating the training data with the target (first use; cached as ")
    where = Path(said[0].rsplit("cached as ", 1)[1].rstrip(")"))
    again: list[str] = []
    assert [d.ids for d in regenerated_documents(cfg, raw, log=again.append)] == [d.ids for d in docs]
    assert again == [f"data: the target's regenerated records {where} (cached)"]
    # other settings are other records; records given as the corpus are used as they are
    other = config_from_dict({**y, "target": {**y["target"], "regen": {**y["target"]["regen"], "max_new_tokens": 4}}},
                             "<t>")
    said = []
    assert regenerated_documents(resolve_target(other, raw, log=lambda _m: None), raw, log=said.append)
    assert said[0].startswith("data: regenerating") and str(where) not in said[0]
    assert regenerated_documents(cfg, docs, log=again.append) == docs


def test_cuda_rows_cap_keeps_prompts_times_heads_inside_cudas_grid_limit() -> None:
    """4096 prompts x 16 Gated DeltaNet value heads crashed fla's kernel launch on an H200 (grid y > 65,535)."""
    from transformers import Qwen3_5TextConfig

    bench = Qwen3_5TextConfig(vocab_size=8192, num_hidden_layers=4, hidden_size=1024, num_attention_heads=8,
                              num_key_value_heads=2, linear_num_key_heads=8, linear_num_value_heads=16)
    cap = cuda_rows_cap(bench)
    assert cap * 16 <= CUDA_GRID_Y_MAX < (cap + 1) * 16 and cap < 4096
    wide = Qwen3_5TextConfig(num_attention_heads=40, num_key_value_heads=8, linear_num_value_heads=32)
    assert cuda_rows_cap(wide) == CUDA_GRID_Y_MAX // 40  # full attention's heads count when they are the most
