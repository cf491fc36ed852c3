"""`dflash export --check`: a good export passes; each SGLang/vLLM loader rule has a broken export that fails with
one line naming the field or tensor and the engine that would misread it; `dflash export` refuses to publish an
export that fails its own check; `--dtype` and the provenance in dflash_export.json.

The broken exports are real directories edited the way a user or another trainer gets them wrong (a config key
edited, a tensor renamed or re-typed, a weight added) and checked through the real CLI.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dflash_fixtures import run_config
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file

from dflash.cli import main
from dflash.export import export_checkpoint
from dflash.train import train


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 0, "eval_every": 1, "eval_prompts": 2},
                     drafter={"num_layers": 2, "layer_sliding_windows": [3, None]},
                     target={"tap_layers": [0, 2]})
    assert train(cfg, out).exit_code == 0
    return out


@pytest.fixture(scope="module")
def good(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_checkpoint(run / "checkpoints" / "step-2", tmp_path_factory.mktemp("exp") / "hf")


def _copy(good: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "broken"
    shutil.copytree(good, dst)
    return dst


def _edit_config(fn: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        fn(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return apply


def _edit_weights(fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        w = load_safetensors(str(d / "model.safetensors"))
        save_file(fn(w), str(d / "model.safetensors"), metadata={"format": "pt"})
    return apply


def _set(**kv: Any) -> Callable[[Path], None]:
    return _edit_config(lambda c: c.update(kv))


def _set_dc(**kv: Any) -> Callable[[Path], None]:
    return _edit_config(lambda c: c["dflash_config"].update(kv))


def _rename(old: str, new: str) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return lambda w: {(new if k == old else k): v for k, v in w.items()}


def _pop(cfg: dict[str, Any], key: str) -> None:
    cfg.pop(key)


def _nan(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w["norm.weight"] = w["norm.weight"].clone()
    w["norm.weight"][0] = float("nan")
    return w


# (rule, edit, the field or tensor the line names, the engine it names)
BROKEN: list[tuple[str, Callable[[Path], None], str, str]] = [
    ("architectures", _set(architectures=["Qwen3ForCausalLM"]), "config.json architectures", "SGLang and vLLM"),
    ("model_type", _set(model_type="llama"), "config.json model_type", "SGLang and vLLM"),
    ("auto_map file", lambda d: (d / "modeling_dflash.py").unlink(), "config.json auto_map", "transformers"),
    ("no dflash_config", _edit_config(lambda c: _pop(c, "dflash_config")), "config.json dflash_config", "vLLM"),
    ("mirror disagrees", _set(block_size=8), "config.json block_size", "SGLang"),
    ("block size", _edit_config(lambda c: (c["dflash_config"].update(block_size=1), c.update(block_size=1))),
     "config.json dflash_config.block_size", "SGLang"),
    ("taps not ints", _set_dc(target_layer_ids=[]), "config.json dflash_config.target_layer_ids", "vLLM"),
    ("taps order", _set_dc(target_layer_ids=[2, 0]), "config.json dflash_config.target_layer_ids", "vLLM"),
    ("taps range", _set_dc(target_layer_ids=[0, 7]), "config.json dflash_config.target_layer_ids", "SGLang"),
    ("taps +1 convention", _set_dc(target_layer_ids=[0, 3]), "layer 3 is the target's last", "SGLang and vLLM"),
    ("num_target_layers", _edit_config(lambda c: _pop(c, "num_target_layers")), "config.json num_target_layers",
     "SGLang"),
    ("eagle aux ids", _set(eagle_aux_hidden_state_layer_ids=[0, 2]), "config.json eagle_aux_hidden_state_layer_ids",
     "vLLM"),
    ("mask id type", _set_dc(mask_token_id="<|mask|>"), "config.json dflash_config.mask_token_id", "SGLang and vLLM"),
    ("mask id vocab", _set_dc(mask_token_id=10**6), "is not below the target's vocabulary", "SGLang and vLLM"),
    ("head_dim", _edit_config(lambda c: _pop(c, "head_dim")), "config.json head_dim", "SGLang and vLLM"),
    ("target_hidden_size", _set(target_hidden_size=64), "config.json target_hidden_size", "vLLM"),
    ("draft_vocab_size", _set(draft_vocab_size=100), "config.json draft_vocab_size", "vLLM"),
    ("hidden_act", _set(hidden_act="gelu"), "config.json hidden_act", "SGLang and vLLM"),
    ("attention_bias", _set(attention_bias=True), "config.json attention_bias", "SGLang and vLLM"),
    ("layer_types length", _set(layer_types=["full_attention"]), "config.json layer_types", "SGLang"),
    ("layer type name", _set(layer_types=["chunked_attention", "full_attention"]), "config.json layer_types",
     "SGLang"),
    ("sliding_window", _set(sliding_window=None), "config.json sliding_window", "SGLang and vLLM"),
    ("use_sliding_window", _set(use_sliding_window=False), "config.json use_sliding_window", "SGLang and vLLM"),
    ("swa_window_size", _set_dc(swa_window_size=5), "config.json dflash_config.swa_window_size", "vLLM"),
    ("use_swa", _set_dc(use_swa=True), "config.json dflash_config.use_swa", "vLLM"),
    ("is_causal", _edit_config(lambda c: _pop(c, "is_causal")), "config.json is_causal",
     "vLLM makes the sliding layers causal"),
    ("dflash causal", _set_dc(causal=True), "config.json dflash_config.causal", "vLLM"),
    ("rope theta", _edit_config(lambda c: c["rope_parameters"].update(rope_theta=5.0)),
     "config.json rope_parameters.rope_theta", "SGLang and vLLM"),
    ("rope scaling", _edit_config(lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0)),
     "config.json rope_parameters", "SGLang and vLLM"),
    ("neox", _set(is_neox_style=False), "config.json is_neox_style", "SGLang and vLLM"),
    ("tensor renamed", _edit_weights(_rename("layers.1.mlp.up_proj.weight", "layers.1.mlp.up.weight")),
     "model.safetensors layers.1.mlp.up_proj.weight: missing", "SGLang and vLLM"),
    ("tensor prefixed", _edit_weights(_rename("norm.weight", "model.norm.weight")),
     "model.safetensors model.norm.weight: unexpected", "SGLang and vLLM"),
    ("embedding shipped", _edit_weights(lambda w: {**w, "embed_tokens.weight": torch.zeros(8, 32)}),
     "model.safetensors embed_tokens.weight", "vLLM then uses it"),
    ("fc shape", _edit_weights(lambda w: {**w, "fc.weight": torch.zeros(32, 96, dtype=w["fc.weight"].dtype)}),
     "model.safetensors fc.weight", "SGLang refuses fc.weight"),
    ("mixed dtypes", _edit_weights(lambda w: {**w, "norm.weight": w["norm.weight"].float()}),
     "model.safetensors dtypes", "SGLang and vLLM"),
    ("declared dtype", _set(dtype="float32"), "config.json dtype", "transformers"),
    ("non-finite", _edit_weights(_nan), "model.safetensors norm.weight: holds NaN", "SGLang and vLLM"),
]


def test_good_export_passes_check(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--check", str(good)]) == 0
    out = capsys.readouterr()
    assert "passes" in out.out and out.err == ""
    # the fixture's drafter mixes a sliding and a full layer: a serving note, not a defect
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in out.out
    # and names the window rule the engines apply to its sliding layer (the one dflash trains)
    assert "sliding layers [0]: SGLang and vLLM apply the window per query position" in out.out


@pytest.mark.parametrize("rule,edit,field,engine", BROKEN, ids=[b[0] for b in BROKEN])
def test_each_rule_fails_a_broken_export_with_its_line(good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       rule: str, edit: Callable[[Path], None], field: str,
                                                       engine: str) -> None:
    d = _copy(good, tmp_path)
    edit(d)
    assert main(["export", "--check", str(d)]) == 1, rule
    lines = capsys.readouterr().err.strip().splitlines()
    hits = [line for line in lines if field in line and engine in line]
    assert hits, f"{rule}: no line names {field!r} and {engine!r} in {lines}"
    assert all(line.startswith("dflash export --check: ") for line in lines)


@pytest.fixture(scope="module")
def causal_good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export of a drafter trained with drafter.sliding_block_causal (its sliding layer causal in the block)."""
    out = tmp_path_factory.mktemp("run-causal")
    cfg = run_config(train={"max_steps": 1, "checkpoint_every": 0, "eval_every": 0},
                     drafter={"num_layers": 2, "layer_sliding_windows": [3, None], "sliding_block_causal": True},
                     target={"tap_layers": [0, 2]})
    assert train(cfg, out).exit_code == 0
    return export_checkpoint(out / "checkpoints" / "step-1", tmp_path_factory.mktemp("exp") / "hf")


def test_a_causal_sliding_export_passes_without_is_causal(causal_good: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert "is_causal" not in json.loads((causal_good / "config.json").read_text())
    assert main(["export", "--check", str(causal_good)]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    assert "sliding layers [0]: is_causal is absent, so vLLM, SGLang and z-lab's modeling run them causal inside the " \
        "block, which is what this drafter was trained for" in out.out


CAUSAL_BROKEN: list[tuple[str, Callable[[Path], None], str, str]] = [
    ("is_causal false", _set(is_causal=False), "config.json is_causal: must be absent", "makes them bidirectional"),
    ("is_causal true", _set(is_causal=True), "config.json is_causal: must be absent", "makes every layer causal"),
    ("dflash_config.causal", _set_dc(causal=False), "config.json dflash_config.causal", "vLLM"),
    ("window from the anchor", _edit_config(lambda c: c["dflash_trained_block_rule"].update(
        sliding_window_from="anchor")), "config.json dflash_trained_block_rule.sliding_window_from",
     "which no engine applies"),
]


@pytest.mark.parametrize("rule,edit,field,words", CAUSAL_BROKEN, ids=[b[0] for b in CAUSAL_BROKEN])
def test_a_causal_sliding_export_fails_what_the_engines_would_run_differently(
        causal_good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], rule: str, edit: Callable[[Path], None],
        field: str, words: str) -> None:
    d = _copy(causal_good, tmp_path)
    edit(d)
    assert main(["export", "--check", str(d)]) == 1, rule
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line for line in lines if field in line and words in line], (rule, lines)


def test_a_bidirectional_export_without_is_causal_still_fails_whatever_else_it_says(
        good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only our record of a causal training excuses a missing is_causal: a bidirectionally trained export (the key
    says so, or is gone too) without it is served causal in its sliding layers."""
    for drop_key in (False, True):
        d = _copy(good, tmp_path / str(drop_key))
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["dflash_trained_block_rule"] == {"sliding_block_causal": False, "sliding_window_from": "query"}
        del cfg["is_causal"]
        if drop_key:
            del cfg["dflash_trained_block_rule"]
        (d / "config.json").write_text(json.dumps(cfg))
        assert main(["export", "--check", str(d)]) == 1
        err = capsys.readouterr().err
        assert "config.json is_causal: must be false" in err and "vLLM makes the sliding layers causal" in err


def _target_dir(tmp_path: Path, **over: Any) -> Path:
    """A Hugging Face target directory as the check reads it: config.json (Qwen3.5 nests text_config) and a
    tokenizer.json vocabulary."""
    d = tmp_path / "target"
    d.mkdir(parents=True)
    text = {"num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 512, "max_position_embeddings": 4096, **over}
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    return d


def test_check_against_the_target_names_each_disagreement(good: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    vocab = json.loads((good / "config.json").read_text())["vocab_size"]
    ok = _target_dir(tmp_path / "a", vocab_size=vocab)
    assert main(["export", "--check", str(good), "--target", str(ok)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    bad = _target_dir(tmp_path / "b", num_hidden_layers=6, hidden_size=64, vocab_size=vocab + 1,
                      max_position_embeddings=10**6)
    tok = {"model": {"vocab": {"<|MASK|>": 3}}, "added_tokens": []}
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["export", "--check", str(good), "--target", str(bad)]) == 1
    err = capsys.readouterr().err
    for want in ("num_target_layers: 4 != the target's 6 layers", "hidden_size: 32 != the target's 64",
                 f"vocab_size: {vocab} != the target's {vocab + 1}", "max_position_embeddings",
                 "the target tokenizer has '<|MASK|>' at 3"):
        assert want in err, (want, err)


def test_export_refuses_to_publish_an_export_that_fails_its_check(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    # tapping the target's last layer trains fine, but no engine can feed it (both read the input of layer id + 1)
    cfg = run_config(train={"max_steps": 1, "checkpoint_every": 0, "eval_every": 0}, target={"tap_layers": [1, 3]},
                     drafter={"num_layers": 2})
    assert train(cfg, out).exit_code == 0
    dst = tmp_path / "hf"
    rc = main(["export", "--checkpoint", str(out / "checkpoints" / "step-1"), "--out", str(dst)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "target_layer_ids: layer 3 is the target's last" in err and f"{dst}: not written" in err
    assert not dst.exists() and not list(tmp_path.glob(".hf.tmp*"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_export_dtype_casts_weights_and_config(run: Path, tmp_path: Path, dtype: str) -> None:
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step-2"), "--out", str(tmp_path / "hf"),
                 "--dtype", dtype]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    weights = load_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    assert cfg["dtype"] == dtype and {str(w.dtype) for w in weights.values()} == {f"torch.{dtype}"}
    assert json.loads((tmp_path / "hf" / "dflash_export.json").read_text())["dtype"] == dtype


def test_export_records_what_the_drafter_was_trained_against(run: Path, good: Path) -> None:
    from dflash.checkpoint import load_file
    from dflash.config import config_from_dict
    from dflash.data import load_tokenizer, read_documents
    from dflash.telemetry import read_events

    info = json.loads((good / "dflash_export.json").read_text())
    meta = load_file(run / "checkpoints" / "step-2", "meta.json")
    assert info["training_step"] == 2 and info["block_size"] == meta["drafter"]["block_size"] == 4
    cfg = config_from_dict(meta["config"], "meta")
    tok = load_tokenizer(cfg.data, read_documents(cfg.data), cfg.data.tokenizer_cache)
    assert info["tokenizer_sha256"] == tok.content_hash
    assert isinstance(info["target_config_sha256"], str) and len(info["target_config_sha256"]) == 64
    evals = [e for e in read_events(run / "events.jsonl") if e["kind"] == "eval"]
    assert [e["step"] for e in evals][-1] == 2
    assert info["eval"]["step"] == 2 and info["eval"]["tau"] == evals[-1]["tau"]


def test_export_takes_the_last_eval_at_or_before_the_checkpoint_step(run: Path, tmp_path: Path) -> None:
    """A checkpoint of step 1 gets step 1's tau, not the later step 2's (the same run's events file)."""
    from dflash.export import last_eval
    from dflash.telemetry import read_events

    evals = {e["step"]: e for e in read_events(run / "events.jsonl") if e["kind"] == "eval"}
    assert set(evals) >= {1, 2}
    assert last_eval(run / "checkpoints" / "step-2", 1)["tau"] == evals[1]["tau"]
    assert last_eval(run / "checkpoints" / "step-2", 0) is None
    moved = tmp_path / "step-2"
    shutil.copytree(run / "checkpoints" / "step-2", moved)
    assert last_eval(moved, 2) is None  # no run directory around it: no tau, still an export
