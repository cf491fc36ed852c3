"""`dflash train --init-from EXPORT_DIR`: start a run from a z-lab-layout drafter (a `dflash export`, or a released
DFlash drafter such as z-lab's for Qwen3.5/3.6) instead of a random init, then train on the user's data.

Why a check first: a released drafter only helps if it is the same network reading the same things. Its weights
must have the shapes this run's drafter config builds, it must read the same target layers (taps), draft the same
block size and feed the same mask token; otherwise the run would train a different model under the old name, or
fail hours later. Every disagreement is one line naming the export's value and the config field to set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash.export_check import read_safetensors_header, served_causal_layers
from dflash.model import DFlashDrafter, DrafterConfig


class InitFromError(ValueError):
    """The export cannot initialise this run's drafter (the message names the field and both values)."""


def _export_config(export_dir: Path) -> dict[str, Any]:
    cfg_path = export_dir / "config.json"
    if not export_dir.is_dir() or not cfg_path.is_file() or not (export_dir / "model.safetensors").is_file():
        raise InitFromError(f"--init-from {export_dir}: not a drafter export (needs config.json and "
                            "model.safetensors, the z-lab DFlashDraftModel layout)")
    try:
        cfg = json.loads(cfg_path.read_text())
        dict(cfg["dflash_config"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InitFromError(f"{cfg_path}: not a DFlashDraftModel config ({exc})") from None
    return cfg


def _value(cfg: dict[str, Any], key: str) -> Any:
    """dflash_config first, then the top level (both layouts exist in released drafters)."""
    return cfg["dflash_config"].get(key, cfg.get(key))


def causal_block_layers(cfg: dict[str, Any]) -> list[int]:
    """The layers whose block runs causal (a query sees only the block tokens up to itself) under the rule vLLM
    applies (`is_causal`, then `dflash_config.causal`, then causal iff the layer is sliding_attention) and SGLang and
    z-lab's modeling file share: a config without `is_causal` runs its sliding layers causal inside the block."""
    return served_causal_layers(cfg)


def sliding_layers(cfg: dict[str, Any]) -> list[int]:
    n = int(cfg.get("num_hidden_layers") or 0)
    return [i for i, t in enumerate(cfg.get("layer_types") or ["full_attention"] * n) if t == "sliding_attention"]


def causal_block_reason(cfg: dict[str, Any], layers: list[int]) -> str:
    why = "is_causal is true" if cfg.get("is_causal") else "dflash_config.causal is true" \
        if (cfg.get("dflash_config") or {}).get("causal") else "its config has no is_causal, and sliding_attention " \
        "layers then run causal inside the block (z-lab's and vLLM's rule)"
    return f"layers {layers} draft the block causally ({why})"


def expressible_causal(cfg: dict[str, Any]) -> bool | None:
    """drafter.sliding_block_causal for the block rule this config makes the engines run, or None when no drafter
    config expresses it: dflash runs the block causal in exactly the sliding layers or in none, never in a
    full-attention layer (is_causal or dflash_config.causal true on a drafter with full layers)."""
    causal = served_causal_layers(cfg)
    if not causal:
        return False
    return True if causal == sliding_layers(cfg) else None


def check_init_from(export_dir: str | Path, dcfg: DrafterConfig, target_hidden: int, taps: list[int]) -> None:
    """Raise InitFromError naming the first disagreement between the export and this run's drafter."""
    src = Path(export_dir)
    cfg = _export_config(src)
    where = f"--init-from {src}"
    got_taps = [int(x) for x in _value(cfg, "target_layer_ids") or []]
    if got_taps != list(taps):
        raise InitFromError(f"{where}: it reads target layers {got_taps}, this run taps {list(taps)}; set "
                            f"target.tap_layers: {got_taps}")
    block = _value(cfg, "block_size")
    if block != dcfg.block_size:
        raise InitFromError(f"{where}: block size {block}, this run drafts {dcfg.block_size}; set "
                            f"drafter.block_size: {block}")
    mask = _value(cfg, "mask_token_id")
    if mask != dcfg.mask_token_id:
        raise InitFromError(f"{where}: mask token id {mask}, this run's is {dcfg.mask_token_id}; set "
                            f"drafter.mask_token_id: {mask} (a row of the same target embedding)")
    if cfg.get("num_hidden_layers") != dcfg.num_layers:
        raise InitFromError(f"{where}: {cfg.get('num_hidden_layers')} layers, drafter.num_layers is "
                            f"{dcfg.num_layers}; set drafter.num_layers: {cfg.get('num_hidden_layers')}")
    n = dcfg.num_layers
    types = cfg.get("layer_types") or ["full_attention"] * n
    windows = [cfg.get("sliding_window") if t == "sliding_attention" else None for t in types]
    ours = dcfg.layer_sliding_windows or [dcfg.sliding_window] * n
    if list(windows) != list(ours):
        raise InitFromError(f"{where}: per-layer sliding windows {windows}, this run's are {ours}; set "
                            f"drafter.layer_sliding_windows: {windows}")
    causal = causal_block_layers(cfg)
    want = expressible_causal(cfg)
    if want is None:
        raise InitFromError(f"{where}: {causal_block_reason(cfg, causal)}; dflash runs the block causal in its "
                            "sliding-window layers at most (drafter.sliding_block_causal), so training from it would "
                            "silently change what its full-attention layers compute")
    sliding = sliding_layers(cfg)
    if sliding and want != bool(dcfg.sliding_block_causal):
        why = causal_block_reason(cfg, causal) if want else "its block is bidirectional in every layer (is_causal " \
            "false)"
        raise InitFromError(f"{where}: {why}; this run's drafter.sliding_block_causal is "
                            f"{str(bool(dcfg.sliding_block_causal)).lower()}: set drafter.sliding_block_causal: "
                            f"{str(want).lower()} (training and its export then keep that rule)")
    if sliding and dcfg.sliding_window_from != "query":
        raise InitFromError(f"{where}: its sliding layers count the window per query position (the engines' rule), "
                            f"this run's drafter.sliding_window_from is {dcfg.sliding_window_from}; set "
                            "drafter.sliding_window_from: query")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 1e6)))
    if theta != float(dcfg.rope_theta):
        raise InitFromError(f"{where}: rope_theta {theta:g}, this run's is {dcfg.rope_theta:g}; set "
                            f"drafter.rope_theta: {theta:g}")
    # Shapes: every tensor of the drafter this config builds (on the meta device: no memory) against the file's.
    with torch.device("meta"):
        want = {k: list(v.shape) for k, v in DFlashDrafter(dcfg, target_hidden, len(taps)).state_dict().items()}
    try:
        have = {k: v["shape"] for k, v in read_safetensors_header(src / "model.safetensors").items()}
    except (OSError, ValueError) as exc:
        raise InitFromError(f"{src / 'model.safetensors'}: cannot be read ({exc})") from None
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise InitFromError(f"{where}: tensors do not match this drafter (missing {missing[:3]}, unexpected "
                            f"{extra[:3]})")
    for k, shape in want.items():
        if have[k] != shape:
            raise InitFromError(f"{where}: {k} has shape {have[k]}, this run's drafter {shape}; "
                                f"{_shape_hint(cfg, k)}")


def _shape_hint(cfg: dict[str, Any], name: str) -> str:
    """The config fields that decide a tensor's shape, with the export's values."""
    fields = ("num_attention_heads", "num_key_value_heads", "head_dim") if "self_attn" in name else \
        ("intermediate_size", "hidden_size") if ".mlp." in name else ("hidden_size",)
    return "the export has " + ", ".join(f"{f}={cfg.get(f)}" for f in fields) + " (set drafter.* and the target " \
        "to match)"


def load_init_from(drafter: DFlashDrafter, export_dir: str | Path) -> dict[str, Any]:
    """Copy the export's weights into `drafter` (cast to its dtype); strict: every tensor, nothing else.
    Returns what the run log says about it."""
    from safetensors.torch import load_file

    src = Path(export_dir)
    state = load_file(str(src / "model.safetensors"))
    drafter.load_state_dict(state, strict=True)  # load_state_dict copies into the drafter's own dtype
    info: dict[str, Any] = {"path": str(src), "dtype": str(next(iter(state.values())).dtype).replace("torch.", "")}
    meta = src / "dflash_export.json"
    if meta.is_file():
        try:
            m = json.loads(meta.read_text())
            info.update({"run_id": m.get("run_id"), "step": m.get("step")})
        except (OSError, ValueError):
            pass
    return info
