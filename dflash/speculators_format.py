"""The formats of `speculators` (the vLLM project's drafter trainer): its offline hidden-state data, and its DFlash
checkpoints brought back into the z-lab layout that `dflash export` writes and SGLang and vLLM serve.

Why here: speculators' own converter goes z-lab -> speculators only, so a drafter it trained cannot reach our exact
tau, `dflash export --check` or `train --init-from` without this reverse step. Facts used (speculators 0.9.0):
- offline data = a `datasets` `save_to_disk` set with `input_ids`, `loss_mask`, `seq_len` (torch format) and
  `hidden_states/hs_{i}.safetensors` holding `token_ids` int64 [T] and `hidden_states` bf16 [T, K+1, H]: the K taps
  by Hugging Face `hidden_states` index (layer id + 1: index 0 is the embedding output), then the last decoder
  layer's output before the final norm (its trainer applies the verifier's norm and LM head to it for the labels);
- a DFlash checkpoint = `config.json` (`speculators_model_type: dflash`, `transformer_layer_config` a qwen3 config,
  `aux_hidden_state_layer_ids` = z-lab `target_layer_ids` + 1, `block_size`, `mask_token_id`,
  `sliding_window_non_causal`) and safetensors whose body names (`fc`, `hidden_norm`, `layers.N.*`, `norm`) are the
  z-lab ones; `embed_tokens` / `lm_head` / `verifier_*` / `t2d` / `d2t` belong to the target or a reduced vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HS_DIR = "hidden_states"
_BODY_TOP = ("fc.weight", "hidden_norm.weight", "norm.weight")
_TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


class ConvertError(ValueError):
    """The speculators checkpoint cannot be expressed in the z-lab layout (one line for the user)."""


def hs_file(data_dir: str | Path, index: int) -> Path:
    return Path(data_dir) / HS_DIR / f"hs_{index}.safetensors"


def write_hs_file(data_dir: str | Path, index: int, token_ids: Any, hidden: Any) -> int:
    """One record's hidden states (token_ids int64 [T], hidden bf16 [T, K+1, H]), written through a temp name so a
    killed writer never leaves a file speculators would read as complete. Returns the bytes written."""
    import torch
    from safetensors.torch import save_file

    if token_ids.dtype != torch.int64 or token_ids.ndim != 1:
        raise ValueError(f"token_ids must be int64 [T], got {token_ids.dtype} {tuple(token_ids.shape)}")
    if hidden.ndim != 3 or hidden.shape[0] != token_ids.shape[0]:
        raise ValueError(f"hidden_states must be [T={token_ids.shape[0]}, K+1, H], got {tuple(hidden.shape)}")
    path = hs_file(data_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"token_ids": token_ids.contiguous().cpu(), "hidden_states": hidden.to(torch.bfloat16).contiguous().cpu()},
              str(tmp))
    tmp.replace(path)
    return path.stat().st_size


def write_dataset(data_dir: str | Path, records: list[dict[str, Any]]) -> None:
    """The `save_to_disk` set speculators' ArrowDataset loads (input_ids, loss_mask, seq_len; torch format)."""
    from datasets import Dataset

    ds = Dataset.from_dict({
        "input_ids": [list(map(int, r["input_ids"])) for r in records],
        "loss_mask": [[int(bool(x)) for x in r["loss_mask"]] for r in records],
        "seq_len": [len(r["input_ids"]) for r in records],
    })
    ds.set_format(type="torch")
    ds.save_to_disk(str(data_dir))


def _read_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConvertError(f"{path}: cannot be read ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: not a JSON object")
    kind = cfg.get("speculators_model_type")
    if kind != "dflash":
        raise ConvertError(f"{path}: speculators_model_type is {kind!r}; only 'dflash' has a z-lab layout "
                           "(DFlash2's convolutions and selector have no counterpart there)")
    return cfg


def _load_weights(src: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{src}: no .safetensors weights")
    state: dict[str, Any] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # noqa: BLE001 - a damaged file: one line, not a traceback
            raise ConvertError(f"{f}: cannot be read ({type(exc).__name__}: {exc})") from None
    return state


def zlab_meta(cfg: dict[str, Any], num_target_layers: int, vocab_size: int) -> dict[str, Any]:
    """The speculators config as the meta `dflash.export.draft_config` reads (drafter + target sections)."""
    tl = cfg.get("transformer_layer_config") or {}
    n = int(tl["num_hidden_layers"])
    types = tl.get("layer_types") or ["full_attention"] * n
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        rule = "bidirectional" if cfg.get("sliding_window_non_causal") else "causal"
        # speculators counts the window from the anchor for every block position and (by default) runs the block
        # causal inside sliding layers; SGLang and vLLM apply the window per query position: what they would serve
        # is not what it trained, so nothing is written rather than an export that silently drafts differently.
        raise ConvertError(f"layers {sliding} are sliding_attention: speculators trained them with the window counted "
                           f"from the anchor and the block {rule} inside it, which no serving engine applies (they "
                           "count the window per query position); retrain with --full-attention-indices covering "
                           "every layer, or keep the speculators format")
    rope = tl.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", tl.get("rope_theta", 1e6)))
    if rope.get("rope_type", "default") != "default" or "mrope_section" in rope:
        raise ConvertError(f"rope {rope}: only the default rotary embedding has a z-lab counterpart here")
    aux = [int(x) for x in cfg.get("aux_hidden_state_layer_ids") or []]
    if not aux:
        raise ConvertError("config.json has no aux_hidden_state_layer_ids")
    if cfg.get("mask_token_id") is None:
        raise ConvertError("config.json has no mask_token_id")
    if cfg.get("sample_from_anchor"):
        raise ConvertError("sample_from_anchor is true: the anchor slot predicts too, which DFlashDraftModel does not")
    if int(cfg.get("draft_vocab_size") or vocab_size) != vocab_size:
        raise ConvertError(f"draft_vocab_size {cfg.get('draft_vocab_size')} != the target's {vocab_size}: a reduced "
                           "draft vocabulary (t2d/d2t) has no z-lab counterpart")
    return {
        "drafter": {"num_layers": n, "num_heads": int(tl["num_attention_heads"]),
                    "num_kv_heads": int(tl["num_key_value_heads"]), "rms_norm_eps": float(tl.get("rms_norm_eps", 1e-6)),
                    "rope_theta": theta, "mask_token_id": int(cfg["mask_token_id"]),
                    "block_size": int(cfg["block_size"]), "layer_sliding_windows": [None] * n},
        # speculators reads hidden_states[id] where z-lab reads hidden_states[id + 1]
        "target": {"vocab_size": vocab_size, "num_layers": num_target_layers, "tap_layers": [a - 1 for a in aux]},
    }


def check_output(dst: Path, dtype: str) -> None:
    """What every conversion into the z-lab layout refuses first: an unknown dtype, an output that holds something."""
    from dflash.export import EXPORT_DTYPES

    if dtype not in EXPORT_DTYPES:
        raise ConvertError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConvertError(f"{dst}: exists and is not an empty directory")


def target_facts(target_dir: str | Path) -> Any:
    """The target's facts the converted config is written against (its layer count and vocabulary must be known)."""
    from dflash.export_check import target_facts_from_dir

    try:
        facts = target_facts_from_dir(target_dir)
    except ValueError as exc:
        raise ConvertError(str(exc)) from None
    if facts.num_layers is None or facts.vocab_size is None:
        raise ConvertError(f"{target_dir}: the target's config names no num_hidden_layers / vocab_size")
    return facts


def speculators_to_zlab(src: str | Path, out: str | Path, target_dir: str | Path, *,
                        dtype: str = "bfloat16") -> dict[str, Any]:
    """Write `out` (z-lab layout, our modeling file alongside) from the speculators DFlash checkpoint `src` trained on
    the target in `target_dir`; refuses a non-empty `out`. The written directory must pass `dflash export --check`
    against that target before it is renamed into place. Returns the written config."""
    from dflash.export import EXPORT_DTYPES, draft_config, publish

    src, dst = Path(src), Path(out)
    check_output(dst, dtype)
    cfg = _read_config(src)
    facts = target_facts(target_dir)
    try:
        meta = zlab_meta(cfg, facts.num_layers, facts.vocab_size)
    except (KeyError, TypeError) as exc:
        raise ConvertError(f"{src / 'config.json'}: not a speculators DFlash config ({exc})") from None
    state = _load_weights(src)
    if "t2d" in state or "d2t" in state:
        raise ConvertError(f"{src}: holds a reduced draft vocabulary (t2d/d2t), which has no z-lab counterpart")
    n = meta["drafter"]["num_layers"]
    body = [k for k in state if k not in _TARGET_OWNED]
    want = set(_BODY_TOP) | {k for k in body if k.startswith("layers.") and int(k.split(".")[1]) < n}
    missing = sorted(k for k in _BODY_TOP if k not in state)
    extra = sorted(set(body) - want)
    if missing or extra:
        raise ConvertError(f"{src}: weights are not a DFlash draft body (missing {missing[:4]}, unexpected {extra[:4]})")
    tensors = {k: state[k].detach().to(EXPORT_DTYPES[dtype]).contiguous() for k in sorted(want)}
    config = draft_config(meta, tensors)
    info = {"converted_from": "speculators", "source": str(src.resolve()),
            "speculators_version": (cfg.get("speculators_version") or "unknown"), "dtype": dtype,
            "target": {"num_layers": facts.num_layers, "vocab_size": facts.vocab_size,
                       "tap_layers": meta["target"]["tap_layers"], "hidden_size": facts.hidden_size}}
    publish(dst, config, tensors, info, facts)
    return config
