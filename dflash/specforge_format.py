"""The formats of SpecForge 0.2.0 (the SGLang project's drafter trainer) that bench/peer.py needs: its offline
DFlash feature files, and its Hugging Face export brought into the z-lab layout `dflash export` writes.

Why here: SpecForge's offline DFlash path trains from per-sample files without SGLang, so the bench can hand it the
same records and target forward as speculators; and its `specforge export --to hf` writes the z-lab weight names and
`dflash_config.target_layer_ids` (z-lab ids, no +1 shift) but keeps `block_size` at the top level only, which
`dflash.eval.load_export` (and z-lab's loader) read from `dflash_config`. Facts used (specforge 0.2.0):
- offline data = one `torch.save`d dict per sample, `{"input_ids": int64 [T], "loss_mask": int64 [T],
  "hidden_states": bf16 [1, T, K*H]}` (the K taps, HF `hidden_states[id + 1]`, concatenated on the last axis; no last
  layer plane), any `*.ckpt` under the data directory (its `OfflineManifestReader` walks it sorted);
  `scripts/prepare_hidden_states.py` names them `rows_<g>-<g+2000>/data_<i>.ckpt`;
- every sample needs two consecutive supervised tokens (its normalizer raises otherwise);
- the export's body names (`fc`, `hidden_norm`, `layers.N.*`, `norm`) are z-lab's; embeddings and LM head are the
  target's and are not written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.speculators_format import ConvertError, check_output, target_facts

ROWS_PER_DIR = 2000
_BODY_TOP = ("fc.weight", "hidden_norm.weight", "norm.weight")


def ckpt_file(data_dir: str | Path, index: int) -> Path:
    """Where SpecForge's own capture script puts sample `index` (2000 per rows_ directory)."""
    g = index // ROWS_PER_DIR * ROWS_PER_DIR
    return Path(data_dir) / f"rows_{g}-{g + ROWS_PER_DIR}" / f"data_{index}.ckpt"


def write_ckpt_file(data_dir: str | Path, index: int, input_ids: Any, loss_mask: Any, hidden: Any) -> int:
    """One sample (input_ids int64 [T], loss_mask [T], hidden [T, K*H]) as SpecForge reads it, written through a temp
    name (its reader lists only *.ckpt, so a killed writer leaves nothing it would read). Returns the bytes written."""
    import torch

    if input_ids.ndim != 1 or hidden.ndim != 2 or hidden.shape[0] != input_ids.shape[0] \
            or loss_mask.shape != input_ids.shape:
        raise ValueError(f"expected input_ids [T], loss_mask [T], hidden [T, K*H]; got {tuple(input_ids.shape)}, "
                         f"{tuple(loss_mask.shape)}, {tuple(hidden.shape)}")
    path = ckpt_file(data_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"input_ids": input_ids.to(torch.int64).contiguous().cpu(),
                "loss_mask": loss_mask.to(torch.int64).contiguous().cpu(),
                "hidden_states": hidden.to(torch.bfloat16).contiguous().cpu()[None]}, str(tmp))
    tmp.replace(path)
    return path.stat().st_size


def specforge_to_zlab(src: str | Path, out: str | Path, target_dir: str | Path, *,
                      dtype: str = "bfloat16") -> dict[str, Any]:
    """Write `out` (z-lab layout, our modeling file alongside) from `specforge export --to hf`'s directory `src`,
    `block_size` copied into `dflash_config`; refuses a non-empty `out`; the result must pass `dflash export --check`
    against the target in `target_dir` before it is renamed into place. Returns the written config."""
    from safetensors.torch import load_file

    from dflash.export import EXPORT_DTYPES, draft_config, publish

    src, dst = Path(src), Path(out)
    check_output(dst, dtype)
    try:
        cfg = json.loads((src / "config.json").read_text())
        state = load_file(str(src / "model.safetensors"))
    except Exception as exc:  # noqa: BLE001 - a missing or damaged export: one line, not a traceback
        raise ConvertError(f"{src}: not a specforge HF export ({type(exc).__name__}: {exc})") from None
    facts = target_facts(target_dir)
    try:
        dc = cfg.get("dflash_config") or {}
        n = int(cfg["num_hidden_layers"])
        block = int(dc.get("block_size", cfg["block_size"]))
        types = cfg.get("layer_types") or ["full_attention"] * n
        if any(t != "full_attention" for t in types):
            raise ConvertError(f"{src}: layer_types {types}: only all-full-attention drafters are converted here")
        if int(cfg.get("draft_vocab_size") or cfg["vocab_size"]) != facts.vocab_size:
            raise ConvertError(f"{src}: draft vocabulary {cfg.get('draft_vocab_size')} != the target's "
                               f"{facts.vocab_size} (a reduced vocabulary has no z-lab counterpart)")
        rope = cfg.get("rope_parameters") or {}
        meta = {"drafter": {"num_layers": n, "num_heads": int(cfg["num_attention_heads"]),
                            "num_kv_heads": int(cfg["num_key_value_heads"]),
                            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
                            "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 1e6))),
                            "mask_token_id": int(dc["mask_token_id"]), "block_size": block,
                            "layer_sliding_windows": [None] * n},
                # SpecForge's target_layer_ids are z-lab's (hidden_states[id + 1]): no shift
                "target": {"vocab_size": facts.vocab_size, "num_layers": facts.num_layers,
                           "tap_layers": [int(x) for x in dc["target_layer_ids"]]}}
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConvertError):
            raise
        raise ConvertError(f"{src / 'config.json'}: not a DFlashDraftModel config ({exc})") from None
    want = set(_BODY_TOP) | {k for k in state if k.startswith("layers.") and int(k.split(".")[1]) < n}
    missing, extra = sorted(k for k in _BODY_TOP if k not in state), sorted(set(state) - want)
    if missing or extra:
        raise ConvertError(f"{src}: weights are not a DFlash draft body (missing {missing[:4]}, unexpected {extra[:4]})")
    tensors = {k: state[k].detach().to(EXPORT_DTYPES[dtype]).contiguous() for k in sorted(want)}
    config = draft_config(meta, tensors)
    info = {"converted_from": "specforge", "source": str(src.resolve()), "dtype": dtype,
            "target": {"num_layers": facts.num_layers, "vocab_size": facts.vocab_size,
                       "tap_layers": meta["target"]["tap_layers"], "hidden_size": facts.hidden_size}}
    publish(dst, config, tensors, info, facts)
    return config
