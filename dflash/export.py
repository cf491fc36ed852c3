"""`dflash export`: a verified training checkpoint -> a Hugging Face directory in the `DFlashDraftModel` format.

The layout is the one z-lab/dflash and SpecForge load: a qwen3-style `config.json` with `dflash_config`
(`target_layer_ids`, `mask_token_id`, `block_size`) and `num_target_layers`, and `model.safetensors` holding `fc`,
`hidden_norm`, `layers.N.*` (qwen3 decoder-layer names) and `norm`; the embedding and LM head stay the target's.
This project's own modeling file ships alongside (`modeling_dflash.py`, registered in `auto_map`), so
`AutoModel.from_pretrained(dir, trust_remote_code=True)` builds the drafter itself rather than a plain Qwen3Model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash.checkpoint import CheckpointError, atomic_directory, load_file, verify_checkpoint

# Our drafter's parameter names already follow the qwen3 layer layout; these are all the exported prefixes.
_TOP_LEVEL = ("fc.weight", "hidden_norm.weight", "norm.weight")
_LAYER_KEYS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


# Shipped next to the weights; written here (dflash/modeling_dflash.py), self-contained so consumers need no dflash.
MODELING_FILE = "modeling_dflash.py"


class ExportError(RuntimeError):
    """The checkpoint cannot be expressed in the DFlashDraftModel format, or the output dir is unusable."""


def draft_config(meta: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The `config.json` of the exported drafter, from the checkpoint's meta.json and its weights' shapes."""
    d = meta["drafter"]
    t = meta["target"]
    hidden = int(state["norm.weight"].shape[0])
    n_layers = int(d["num_layers"])
    head_dim = int(state["layers.0.self_attn.q_norm.weight"].shape[0])
    intermediate = int(state["layers.0.mlp.gate_proj.weight"].shape[0])
    windows = d.get("layer_sliding_windows") or [d.get("sliding_window")] * n_layers
    layer_types = ["sliding_attention" if w else "full_attention" for w in windows]
    sizes = sorted({int(w) for w in windows if w})
    if len(sizes) > 1:  # the qwen3 config format has one `sliding_window` for every sliding layer
        raise ExportError(f"drafter layers use different sliding windows {sizes}; the export format holds one")
    sliding = sizes[0] if sizes else None
    dtype = str(state["fc.weight"].dtype).replace("torch.", "")
    if d.get("mask_token_id") is None:
        raise ExportError("checkpoint meta.json has no drafter.mask_token_id")
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": f"{MODELING_FILE[:-3]}.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(d["num_heads"]),
        "num_key_value_heads": int(d["num_kv_heads"]),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(d["rms_norm_eps"]),
        "rope_theta": float(d["rope_theta"]),
        "rope_parameters": {"rope_theta": float(d["rope_theta"]), "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": int(t["vocab_size"]),
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "layer_types": layer_types,
        "sliding_window": sliding,
        "use_sliding_window": sliding is not None,
        "max_window_layers": n_layers,
        "is_causal": False,  # a block sees itself bidirectionally
        "use_cache": False,
        "dtype": dtype,
        "block_size": int(d["block_size"]),
        "num_target_layers": int(t["num_layers"]),
        "dflash_config": {
            "block_size": int(d["block_size"]),
            "target_layer_ids": [int(x) for x in t["tap_layers"]],  # read from hidden_states[id + 1]
            "mask_token_id": int(d["mask_token_id"]),
        },
    }


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Verify `checkpoint`, then write `out` atomically (temp dir + rename); refuses a non-empty `out`."""
    from safetensors.torch import save_file

    src = Path(checkpoint)
    if not src.is_dir():
        raise ExportError(f"{src}: not a checkpoint directory")
    manifest = verify_checkpoint(src)
    for name in ("drafter.pt", "meta.json"):
        if name not in manifest["files"]:
            raise CheckpointError(f"{src / name}: missing from the manifest (not a dflash training checkpoint)")
    dst = Path(out)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ExportError(f"{dst}: exists and is not an empty directory")
    meta = load_file(src, "meta.json")
    state = load_file(src, "drafter.pt")
    n_layers = int(meta["drafter"]["num_layers"])
    wanted = [*_TOP_LEVEL, *(f"layers.{i}.{k}" for i in range(n_layers) for k in _LAYER_KEYS)]
    missing = [k for k in wanted if k not in state]
    extra = sorted(set(state) - set(wanted))
    if missing or extra:
        raise ExportError(f"{src / 'drafter.pt'}: weights do not match the DFlashDraftModel layout "
                          f"(missing {missing[:5]}, unexpected {extra[:5]})")
    cfg = draft_config(meta, state)
    with atomic_directory(dst) as tmp:
        tensors = {k: state[k].detach().contiguous().cpu() for k in wanted}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        shutil.copyfile(Path(__file__).with_name(MODELING_FILE), tmp / MODELING_FILE)
        (tmp / "dflash_export.json").write_text(json.dumps({
            "source": str(src.resolve()), "step": int(manifest["step"]), "run_id": meta.get("run_id"),
            "target": meta["target"]}, indent=2) + "\n")
    return dst
