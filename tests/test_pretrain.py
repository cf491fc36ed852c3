"""Tests of target pretraining: the tiny hybrid target learns the corpus, saves as a complete HF directory, is cached
by content, and `dflash train` with `target.pretrain` trains the drafter against it.

The pretrained target is built once per test process and content-cached on disk (pretrained_target_cfg), so test_regen
reuses it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from dflash_fixtures import tiny_run_yaml, tokenizer_cache

from dflash.cli import main
from dflash.config import ConfigError, config_from_dict
from dflash.data import load_tokenizer, read_documents
from dflash.pretrain import check_pretrain, pretrain_key, resolve_target
from dflash.target import TargetPretrainConfig

# Small enough to train in seconds on 2 cores, big enough to learn well past token frequencies.
PRETRAIN = {"steps": 120, "batch_size": 8, "seq_len": 48, "lr": 5e-3}


def pretrained_yaml(**pretrain: Any) -> dict[str, Any]:
    """The test run config with a pretrained target (standard 0.02 init: the tiny yaml's 0.25 is for random targets)."""
    y = tiny_run_yaml()
    y["target"]["arch"].pop("initializer_range", None)
    y["target"]["pretrain"] = {**PRETRAIN, "cache_dir": str(tokenizer_cache() / "targets"), **pretrain}
    return y


def pretrained_target_cfg() -> Any:
    """The test config resolved to its pretrained target (trained on first use in this cache, then reused)."""
    cfg = config_from_dict(pretrained_yaml(), "<test>")
    return resolve_target(cfg, read_documents(cfg.data), log=lambda _m: None)


@pytest.fixture(scope="module")
def resolved() -> Any:
    return pretrained_target_cfg()


def test_pretrained_target_beats_unigram_and_is_a_complete_hf_directory(resolved: Any) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(resolved.target.path)
    summary = json.loads((path / "pretrain.json").read_text())
    # held-out loss well under the unigram bar: it learnt context, not just token frequencies
    assert summary["loss"]["val"] < summary["unigram_val_nats"] - 0.3, summary["loss"]
    assert summary["loss"]["last10"] < summary["loss"]["first"] - 1.0
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert [t for t in model.config.layer_types] == ["linear_attention", "linear_attention", "full_attention",
                                                      "linear_attention"]
    # the saved tokenizer is the run's own: same ids for the same text, so `eval --target DIR` encodes correctly
    docs = read_documents(resolved.data)
    tok = load_tokenizer(resolved.data, docs, resolved.data.tokenizer_cache)
    text = docs[0].text[:400]
    assert AutoTokenizer.from_pretrained(str(path))(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert summary["tokenizer_hash"] == tok.content_hash and model.config.vocab_size == tok.vocab_size


def test_resolve_target_reuses_the_cache_and_keys_it_by_content(resolved: Any) -> None:
    path = Path(resolved.target.path)
    stamp = (path / "pretrain.json").stat().st_mtime_ns
    said: list[str] = []
    cfg = config_from_dict(pretrained_yaml(), "<test>")
    again = resolve_target(cfg, read_documents(cfg.data), log=said.append)
    assert again.target.path == str(path) and (path / "pretrain.json").stat().st_mtime_ns == stamp
    assert said == [f"target: pretrained {path} (cached)"]
    assert again.data.tokenizer_cache == cfg.data.tokenizer_cache  # a configured cache is kept
    unpinned = pretrained_yaml()
    del unpinned["data"]["tokenizer_cache"]  # else the BPE the target learnt is pinned for every consumer
    pinned = resolve_target(config_from_dict(unpinned, "<t>"), read_documents(cfg.data), log=said.append)
    assert pinned.data.tokenizer_cache == str(tokenizer_cache() / "targets" / "tokenizer")
    assert pinned.target.path == str(path)
    # anything the weights depend on names another directory; where the cache lives does not
    docs = read_documents(cfg.data)
    tok = load_tokenizer(again.data, docs, again.data.tokenizer_cache)
    key = pretrain_key(cfg, docs, tok)
    assert path.name == f"target-{key}"
    assert pretrain_key(config_from_dict(pretrained_yaml(lr=1e-3), "<t>"), docs, tok) != key
    assert pretrain_key(config_from_dict(pretrained_yaml(cache_dir="/elsewhere"), "<t>"), docs, tok) == key
    assert pretrain_key(cfg, docs[:-1], tok) != key
    # a config that names its target is left alone
    named = config_from_dict({**pretrained_yaml(), "target": {"path": str(path)}}, "<t>")
    assert resolve_target(named, docs) is named


def test_bad_pretrain_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"target\.pretrain\.steps: must be at least 1, got 0"):
        check_pretrain(TargetPretrainConfig(steps=0))
    with pytest.raises(ConfigError, match=r"target\.pretrain\.warmup_frac"):
        check_pretrain(TargetPretrainConfig(warmup_frac=1.5))
    with pytest.raises(ConfigError, match=r"target\.pretrain\.stepz: unknown field"):
        config_from_dict({"target": {"pretrain": {"stepz": 3}}}, "<t>")


def test_dflash_train_with_target_pretrain_trains_against_the_cached_target(resolved: Any, tmp_path: Path) -> None:
    from dflash.checkpoint import latest_checkpoint, load_file

    cfg_file = tmp_path / "run.yaml"
    y = pretrained_yaml()
    y["train"].update({"max_steps": 2, "checkpoint_every": 0})
    cfg_file.write_text(yaml.safe_dump(y))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg_file), "--out", str(out)]) == 0
    meta = load_file(latest_checkpoint(out), "meta.json")
    assert meta["target"]["path"] == resolved.target.path  # the checkpoint names the target it was trained against
    assert f"target: pretrained {resolved.target.path} (cached)" in (out / "train.log").read_text()


def test_pretrain_target_cli_writes_an_hf_directory_and_refuses_a_busy_out(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(pretrained_yaml(steps=2)))
    out = tmp_path / "target"
    assert main(["pretrain-target", "--config", str(cfg_file), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "pretrain.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "pretrain.json").read_text())["settings"]["steps"] == 2
    assert main(["pretrain-target", "--config", str(cfg_file), "--out", str(out)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_reference_delta_rule_swaps_the_chunk_op_for_training_and_restores_it() -> None:
    """Where fla refuses its gated backward (Hopper + Triton < 3.7.1), pretraining trains through transformers' own
    PyTorch delta rule: inside the context the mixers' module global is the raw reference, same loss, gradients flow;
    on exit the loaded binding is back. On a CPU the refusal never applies."""
    import sys

    import torch

    from dflash.kernels import _is_fallback_wrapper, fla_backward_refused, reference_delta_rule
    from dflash.target import TargetConfig, build_target_model

    assert fla_backward_refused("cpu") is False
    model = build_target_model(TargetConfig(), 97)
    mod = sys.modules[type(model).__module__]
    loaded = mod.torch_chunk_gated_delta_rule
    assert _is_fallback_wrapper(loaded)
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    before = model(input_ids=x, labels=x, use_cache=False).loss
    swap = reference_delta_rule(model)
    assert swap.active
    with swap:
        assert mod.torch_chunk_gated_delta_rule is not loaded
        assert not _is_fallback_wrapper(mod.torch_chunk_gated_delta_rule)
        inside = model(input_ids=x, labels=x, use_cache=False).loss
        inside.backward()
    assert mod.torch_chunk_gated_delta_rule is loaded
    torch.testing.assert_close(inside, before)
    grads = [p.grad for n, p in model.named_parameters() if "linear_attn" in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
