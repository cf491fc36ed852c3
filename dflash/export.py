"""`dflash export`: a verified training checkpoint -> a Hugging Face directory in the `DFlashDraftModel` format.

The layout is the one z-lab/dflash and SpecForge load: a qwen3-style `config.json` with `dflash_config`
(`target_layer_ids`, `mask_token_id`, `block_size`) and `num_target_layers`, and `model.safetensors` holding `fc`,
`hidden_norm`, `layers.N.*` (qwen3 decoder-layer names) and `norm`; the embedding and LM head stay the target's.
This project's own modeling file ships alongside (`modeling_dflash.py`, registered in `auto_map`), so
`AutoModel.from_pretrained(dir, trust_remote_code=True)` builds the drafter itself rather than a plain Qwen3Model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import torch

from dflash.checkpoint import CheckpointError, atomic_directory, load_file, verify_checkpoint
from dflash.export_check import TRAINED_RULE_KEY

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
    causal, window_from = bool(d.get("sliding_block_causal", False)), str(d.get("sliding_window_from", "query"))
    if sliding is not None and window_from != "query":
        raise ExportError(f"drafter.sliding_window_from: {window_from}: the sliding layers were trained with the window "
                          "counted from the anchor (speculators' rule), which no engine serves (SGLang, vLLM and "
                          "z-lab count it per query position); `dflash eval` measures this checkpoint, an export "
                          "needs a run with sliding_window_from: query")
    cfg = {
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
        "is_causal": False,  # a block sees itself bidirectionally (dropped below for a causal-sliding drafter)
        "use_cache": False,
        "dtype": dtype,
        "block_size": int(d["block_size"]),
        "num_target_layers": int(t["num_layers"]),
        "dflash_config": {
            "block_size": int(d["block_size"]),
            "target_layer_ids": [int(x) for x in t["tap_layers"]],  # read from hidden_states[id + 1]
            "mask_token_id": int(d["mask_token_id"]),
        },
        # ours alone (export_check.TRAINED_RULE_KEY): no engine reads it; `dflash export --check` compares it with
        # what the engines derive from is_causal. Never dflash_config.causal: vLLM reads that one.
        TRAINED_RULE_KEY: {"sliding_block_causal": causal, "sliding_window_from": window_from},
    }
    if causal and sliding is not None:
        # Trained causal in the sliding layers only: no is_causal value says that (true makes every layer causal),
        # its absence does: vLLM, SGLang and z-lab's modeling then run exactly the sliding_attention layers causal.
        del cfg["is_causal"]
    return cfg


EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ExportCheckFailed(ExportError):
    """The written export fails `dflash export --check`: nothing was published at the output path."""

    def __init__(self, out: Path, problems: list[str]) -> None:
        super().__init__(f"{out}: not written, the export fails {len(problems)} serving check(s): {problems[0]}")
        self.problems = problems


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, dtype: str = "bfloat16",
                      target_dir: str | Path | None = None) -> Path:
    """Verify `checkpoint`, then write `out` atomically (temp dir + rename); refuses a non-empty `out`.

    The weights are cast to `dtype` (bfloat16 by default, like the released drafters). The written directory must
    pass `dflash export --check` (dflash/export_check.py) against the target the run trained with (its meta.json,
    or `target_dir`) before it is renamed into place: an export an engine would misread is never published."""
    from dflash.export_check import TargetFacts, target_facts_from_dir

    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")

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
    tensors = {k: state[k].detach().to(EXPORT_DTYPES[dtype]).contiguous().cpu() for k in wanted}
    cfg = draft_config(meta, tensors)
    t = meta["target"]
    facts = target_facts_from_dir(target_dir) if target_dir is not None else TargetFacts(
        num_layers=t.get("num_layers"), hidden_size=t.get("hidden_size"), vocab_size=t.get("vocab_size"),
        source=f"{src / 'meta.json'} target")
    info = {**portable_source(src), "step": int(manifest["step"]), "run_id": meta.get("run_id"),
            "target": portable_target(t), "dtype": dtype, **provenance(src, meta, int(manifest["step"]))}
    return publish(dst, cfg, tensors, info, facts)


def publish(dst: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], info: dict[str, Any],
            facts: Any) -> Path:
    """Write an export directory atomically (config.json, model.safetensors, our modeling file, dflash_export.json)
    and rename it into place only if it passes every `dflash export --check` rule against `facts` (the target)."""
    from safetensors.torch import save_file

    from dflash.export_check import check_export

    with atomic_directory(dst) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors writes through a private temp file (mode 0600): give the weights the mode every other file of
        # the export got from the umask, or a serving user other than the exporter cannot read them
        os.chmod(tmp / "model.safetensors", stat.S_IMODE((tmp / "config.json").stat().st_mode))
        shutil.copyfile(Path(__file__).with_name(MODELING_FILE), tmp / MODELING_FILE)
        (tmp / "dflash_export.json").write_text(json.dumps(info, indent=2) + "\n")
        checked = check_export(tmp, facts)
        if checked.problems:
            raise ExportCheckFailed(dst, checked.problems)  # atomic_directory removes the temp dir
    return dst


def portable_source(src: Path) -> dict[str, Any]:
    """Which checkpoint the export came from, in terms that mean the same on another machine: its path inside the
    run directory and its manifest's sha256 (the checkpoint's content). The absolute path is kept only as a hint for
    `dflash eval --drafter` on the exporting machine, named so: elsewhere it points at nothing."""
    inside = f"{src.parent.name}/{src.name}" if src.parent.name == "checkpoints" else src.name
    return {"source_checkpoint": inside,
            "source_manifest_sha256": hashlib.sha256((src / "manifest.json").read_bytes()).hexdigest(),
            "source_local_path_informational": str(src.resolve())}


def portable_target(t: dict[str, Any]) -> dict[str, Any]:
    """The target's facts from the checkpoint's meta.json, its location made portable: a Hugging Face hub id stays
    (`hub_id`, resolvable anywhere); a local directory (a pretrained target under the exporter's cache, a model dir)
    is kept only as `local_path_informational`. What identifies the target anywhere is `target_config_sha256`."""
    out = {k: v for k, v in t.items() if k != "path"}
    path = t.get("path")
    local = isinstance(path, str) and (Path(path).is_absolute() or Path(path).expanduser().exists())
    out["hub_id"] = path if isinstance(path, str) and not local else None
    out["local_path_informational"] = str(Path(path).expanduser().resolve()) if local else None
    return out


def provenance(src: Path, meta: dict[str, Any], step: int) -> dict[str, Any]:
    """What the drafter was trained against, for whoever serves it later: the target's config hash, the tokenizer's
    content hash, block size, training step, and tau from the run's last `eval` event at or before this step.

    Each is best effort (None with the reason's absence): an export of a checkpoint whose run directory is gone is
    still an export."""
    d = meta["drafter"]
    return {"block_size": int(d["block_size"]), "training_step": step,
            "target_config_sha256": _target_config_hash(meta), "tokenizer_sha256": _tokenizer_hash(src, meta),
            "eval": last_eval(src, step)}


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _target_config_hash(meta: dict[str, Any]) -> str | None:
    """sha256 of the target's config: its config.json as a dict (path targets), else the config the random-init
    target is built from (family, arch, embedding rows); key order and whitespace do not count."""
    t = meta["target"]
    try:
        if t.get("path"):
            return _sha(json.loads((Path(t["path"]) / "config.json").read_text()))
        from dflash.config import config_from_dict
        from dflash.target import target_hf_config

        cfg = config_from_dict(meta["config"], "meta.json:config")
        hf = target_hf_config(cfg.target, int(t["vocab_size"])).to_dict()
        hf.pop("transformers_version", None)
        return _sha(hf)
    except Exception:  # noqa: BLE001 - provenance must not fail an export
        return None


def _tokenizer_hash(src: Path, meta: dict[str, Any]) -> str | None:
    """The run's tokenizer content hash (dflash.data.TokenizerAdapter.content_hash: what it does, not where it is):
    data.tokenizer, else the one regenerated records are pinned to (regen.json), else the run's tiny BPE."""
    try:
        from dflash.config import config_from_dict
        from dflash.data import REGEN_MANIFEST, TokenizerAdapter, load_tokenizer, read_documents

        cfg = config_from_dict(meta["config"], "meta.json:config")
        if cfg.data.tokenizer is not None:
            from transformers import AutoTokenizer

            return TokenizerAdapter(hf=AutoTokenizer.from_pretrained(cfg.data.tokenizer)).content_hash
        for p in map(Path, cfg.data.paths):
            manifest = (p if p.is_dir() else p.parent) / REGEN_MANIFEST
            if manifest.is_file():
                return str(json.loads(manifest.read_text())["tokenizer"]["content_hash"])
        run_dir = src.parent.parent if src.parent.name == "checkpoints" else None
        cache = Path(cfg.data.tokenizer_cache) if cfg.data.tokenizer_cache else \
            (run_dir / "tokenizer" if run_dir is not None else None)
        if cache is None or not cache.is_dir():
            return None
        return load_tokenizer(cfg.data, read_documents(cfg.data), cache).content_hash
    except Exception:  # noqa: BLE001 - provenance must not fail an export
        return None


def last_eval(src: Path, step: int) -> dict[str, Any] | None:
    """The run's `eval` event of this checkpoint's step, else its last one before it (OUT/events.jsonl, OUT being
    two levels above checkpoints/step-N); None when the run measured none or its directory is gone."""
    from dflash.telemetry import read_events

    if src.parent.name != "checkpoints":
        return None
    path = src.parent.parent / "events.jsonl"
    if not path.is_file():
        return None
    best: dict[str, Any] | None = None
    try:
        for ev in read_events(path):
            if ev.get("kind") != "eval" or not isinstance(ev.get("step"), int) or ev["step"] > step:
                continue
            if best is None or ev["step"] >= best["step"]:
                best = ev
    except OSError:
        return None
    if best is None:
        return None
    keys = ("step", "tau", "ngram_tau", "block_size", "sequences", "tokens", "tau_ci95", "accept_by_position")
    return {k: best[k] for k in keys if k in best}
