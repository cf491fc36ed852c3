"""`dflash eval`: the acceptance length tau a trained drafter reaches on its own target, always checked lossless.

Loads a checkpoint (or an exported drafter), picks held-out prompts, and reports DFlash next to prompt lookup and the
training-time per-position accuracy of the same checkpoint on the same text (the train/serve gap made visible).

Held-out text, deterministic and never trained on by the run: with the embedded corpus (Python's stdlib sources,
capped at `data.max_chars`) the stdlib files after the cap; with configured data the documents none of whose pieces
is in any buffer the run's schedule feeds to the drafter over the whole planned run. How they are picked, and the
statistics, are dflash/measure.py's (training measures with the same).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.config import ConfigError, RunConfig, config_from_dict, load_config
from dflash.data import DataError, Document, TokenizerAdapter
from dflash.evalprogress import EvalProgress, isatty
from dflash.kernels import float32_is_exact
from dflash.measure import (  # noqa: F401 (re-exported: `dflash eval`'s library half lives there)
    EvalError,
    acceptance_stats,
    embedded_heldout,
    greedy_sequences,
    heldout_documents_of,
    prompts_from_documents,
    scheduled_doc_indices,
    tau_interval,
)
from dflash.model import DFlashDrafter, DraftBatch, DrafterConfig
from dflash.speculative import (
    DFlashProposer,
    Generation,
    LosslessError,
    NgramProposer,
    TargetLM,
    first_difference,
    speculative_generate,
    target_greedy,
)
from dflash.telemetry import stderr_line

# ----------------------------------------------------------------------------- loading


@dataclass
class Loaded:
    """A drafter with everything needed to evaluate it."""

    drafter: DFlashDrafter
    tap_layers: list[int]
    source: str  # what was loaded, for the report
    cfg: RunConfig | None  # the run's config (target, data, tokenizer), when known
    run_dir: Path | None  # the run directory (tokenizer cache, schedule), when known
    pipeline: dict[str, Any] | None  # the checkpoint's pipeline.json (planned run length, drafter ranks)
    target_meta: dict[str, Any]  # num_layers, vocab_size, path (None = random init from the config) ...


def _drafter_config(d: dict[str, Any]) -> DrafterConfig:
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    return DrafterConfig(**{k: v for k, v in d.items() if k in known})


def _build_drafter(dcfg: DrafterConfig, state: dict[str, torch.Tensor], hidden: int, n_taps: int,
                   where: str) -> DFlashDrafter:
    # Dense attention: exact on any device, and eval shapes change every step (flex would recompile).
    dcfg = dataclasses.replace(dcfg, attention="dense")
    drafter = DFlashDrafter(dcfg, hidden, n_taps)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise EvalError(f"{where}: weights do not fit the drafter (missing {missing[:4]}, unexpected {unexpected[:4]})")
    return drafter.eval().requires_grad_(False)


def load_checkpoint(path: str | Path) -> Loaded:
    """A verified `RUN/checkpoints/step-N`: drafter weights, the run's config and target description."""
    from dflash.checkpoint import CheckpointError, load_file, verify_checkpoint

    src = Path(path)
    if not src.is_dir():
        raise EvalError(f"{src}: not a checkpoint directory")
    try:
        manifest = verify_checkpoint(src)
    except CheckpointError as exc:
        raise EvalError(str(exc)) from None
    for name in ("drafter.pt", "meta.json"):
        if name not in manifest["files"]:
            raise EvalError(f"{src / name}: missing from the manifest (not a dflash training checkpoint)")
    meta = load_file(src, "meta.json")
    pipeline = load_file(src, "pipeline.json") if "pipeline.json" in manifest["files"] else None
    t = meta["target"]
    cfg = None
    if "config" in meta:
        try:
            cfg = config_from_dict(meta["config"], f"{src / 'meta.json'}:config")
        except ConfigError as exc:  # saved by an older dflash whose config no longer validates: --config must say
            stderr_line(f"dflash eval: the checkpoint's saved config is not usable ({exc}); pass --config")
    drafter = _build_drafter(_drafter_config(meta["drafter"]), load_file(src, "drafter.pt"), int(t["hidden_size"]),
                             len(t["tap_layers"]), str(src / "drafter.pt"))
    run_dir = src.parent.parent if src.parent.name == "checkpoints" else None
    return Loaded(drafter=drafter, tap_layers=[int(x) for x in t["tap_layers"]], source=str(src), cfg=cfg,
                  run_dir=run_dir, pipeline=pipeline, target_meta=dict(t))


def load_export(path: str | Path) -> Loaded:
    """A `dflash export` directory (DFlashDraftModel format); the run is found through dflash_export.json if it is
    still there (its config describes a random-init target and the corpus)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file as load_safetensors

    src = Path(path)
    cfg_path = src / "config.json"
    if not cfg_path.is_file() or not (src / "model.safetensors").is_file():
        raise EvalError(f"{src}: not a drafter directory (needs config.json and model.safetensors)")
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EvalError(f"{cfg_path}: cannot be read as JSON ({exc})") from None
    from dflash.init_from import causal_block_layers, causal_block_reason, expressible_causal

    # the block rule the engines run for this config (is_causal...): our drafter computes it when the causal layers
    # are exactly the sliding ones (drafter.sliding_block_causal) or none; otherwise its tau would not be this export's
    sliding_causal = expressible_causal(hf) if isinstance(hf, dict) else False
    if sliding_causal is None:
        raise EvalError(f"{cfg_path}: {causal_block_reason(hf, causal_block_layers(hf))}, which dflash's drafter does "
                        "not compute (causal in full-attention layers); its tau cannot be measured here")
    try:
        dc = hf["dflash_config"]
        n = int(hf["num_hidden_layers"])
        windows = [hf.get("sliding_window") if t == "sliding_attention" else None
                   for t in hf.get("layer_types", ["full_attention"] * n)]
        dcfg = DrafterConfig(num_layers=n, hidden_size=int(hf["hidden_size"]), num_heads=int(hf["num_attention_heads"]),
                             num_kv_heads=int(hf["num_key_value_heads"]), head_dim=int(hf["head_dim"]),
                             intermediate_size=int(hf["intermediate_size"]), block_size=int(dc["block_size"]),
                             mask_token_id=int(dc["mask_token_id"]), rope_theta=float(hf.get("rope_theta", 1e6)),
                             rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), layer_sliding_windows=windows,
                             sliding_block_causal=bool(sliding_causal))
        taps = [int(x) for x in dc["target_layer_ids"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise EvalError(f"{cfg_path}: not a DFlashDraftModel config ({exc})") from None
    try:
        state = load_safetensors(str(src / "model.safetensors"))
    except (OSError, SafetensorError) as exc:  # a truncated or damaged file: one line, not a traceback
        raise EvalError(f"{src / 'model.safetensors'}: cannot be read ({exc}); `dflash export --check {src}` "
                        "says what is wrong") from None
    drafter = _build_drafter(dcfg, state, int(hf["hidden_size"]), len(taps), str(src / "model.safetensors"))
    target_meta: dict[str, Any] = {"num_layers": hf.get("num_target_layers"), "tap_layers": taps,
                                   "hidden_size": int(hf["hidden_size"]), "vocab_size": int(hf["vocab_size"]),
                                   "path": None}
    cfg = run_dir = pipeline = None
    info_path = src / "dflash_export.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        target_meta.update(_export_target(info.get("target") or {}))
        # the exporting machine's path is only a hint (dflash_export.json names it so): used when it still holds
        # the very checkpoint (same manifest hash); an export made before the hash was recorded has `source`
        ckpt_dir = Path(info.get("source_local_path_informational") or info.get("source") or "/nonexistent")
        want = info.get("source_manifest_sha256")
        if (ckpt_dir / "meta.json").is_file() and (want is None or _manifest_sha(ckpt_dir) == want):
            try:
                run = load_checkpoint(ckpt_dir)
                cfg, run_dir, pipeline = run.cfg, run.run_dir, run.pipeline
            except EvalError:
                pass  # the source checkpoint moved on or was pruned: --config / --target must say
    return Loaded(drafter=drafter, tap_layers=taps, source=str(src), cfg=cfg, run_dir=run_dir, pipeline=pipeline,
                  target_meta=target_meta)


def _export_target(t: dict[str, Any]) -> dict[str, Any]:
    """dflash_export.json's target as load_target reads it: `path` is its hub id, else the exporter's local path
    when it exists here (an export moved to another machine then needs --target or --config)."""
    out = {k: v for k, v in t.items() if k not in ("hub_id", "local_path_informational")}
    local = t.get("local_path_informational")
    if t.get("hub_id") or local:
        out["path"] = t.get("hub_id") or (local if Path(local).is_dir() else None)
    return out


def _manifest_sha(ckpt_dir: Path) -> str | None:
    import hashlib

    try:
        return hashlib.sha256((ckpt_dir / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return None


def load_target(loaded: Loaded, target_dir: str | None, device: torch.device) -> TargetLM:
    """The frozen target the drafter was trained against: --target DIR, the run's target.path, or the run's random
    init (family + arch + seed, as many embedding rows as the checkpoint says), built by the target registry."""
    from dflash.target import TargetConfig, build_target_model, hf_progress_bars

    vocab = loaded.target_meta.get("vocab_size")
    if target_dir is not None:
        tcfg = TargetConfig(path=target_dir)
    elif loaded.cfg is not None:
        tcfg = loaded.cfg.target
    elif loaded.target_meta.get("path"):
        tcfg = TargetConfig(path=str(loaded.target_meta["path"]))
    else:
        raise EvalError(f"{loaded.source}: cannot tell which target this drafter drafts for; pass --target DIR "
                        "(a local Hugging Face model) or --config RUN_CONFIG (the run's config)")
    t0, tty = time.perf_counter(), isatty(sys.stderr)
    try:
        with hf_progress_bars(tty):  # a pipe or a log gets one plain line, not transformers' `\r` bar
            model = build_target_model(tcfg, int(vocab) if vocab else None, device=device)
    except (ValueError, OSError) as exc:
        raise EvalError(f"target: {exc}") from None
    if not tty:
        print(f"dflash eval: target {tcfg.path or 'random init (the run config)'} loaded in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    model.to(device).eval().requires_grad_(False)
    hidden = int(model.config.get_text_config().hidden_size)
    if hidden != loaded.drafter.hidden_size:
        raise EvalError(f"target hidden size {hidden} != drafter hidden size {loaded.drafter.hidden_size}")
    try:
        return TargetLM(model, loaded.tap_layers)
    except ValueError as exc:
        raise EvalError(f"target: {exc}") from None


def resolve_pretrained(cfg: RunConfig, docs: Sequence[Document] | None) -> RunConfig:
    """A config given with --config that asks for a pretrained target (`target.pretrain`) names the cached one, as
    `dflash train` resolved it (a checkpoint's saved config is already resolved)."""
    if cfg.target.path is not None or getattr(cfg.target, "pretrain", None) is None:
        return cfg
    if docs is None:
        from dflash.data import read_documents

        docs = read_documents(cfg.data)
    from dflash.pretrain import resolve_target

    return resolve_target(cfg, docs, log=lambda msg: print(msg, file=sys.stderr))


def load_tokenizer_for(loaded: Loaded, target_dir: str | None, docs: Sequence[Document] | None) -> TokenizerAdapter:
    """The run's tokenizer (its HF directory, or the tiny BPE cached in the run), else the target directory's; it
    renders chats with the run's data.thinking, as training did (`keep` without a run config)."""
    from dflash.data import load_tokenizer

    cfg = loaded.cfg
    if cfg is not None and (cfg.data.tokenizer is not None or docs is not None):
        cache = Path(cfg.data.tokenizer_cache) if cfg.data.tokenizer_cache else \
            (loaded.run_dir / "tokenizer" if loaded.run_dir is not None else None)
        if cfg.data.tokenizer is None and cache is None:
            raise EvalError("the tiny BPE of this run cannot be found: pass --config with data.tokenizer_cache")
        return load_tokenizer(cfg.data, list(docs or []), cache or Path("."))
    where = target_dir or loaded.target_meta.get("path")
    if where is None:
        raise EvalError("no tokenizer: pass --config RUN_CONFIG or --target DIR with a tokenizer")
    from transformers import AutoTokenizer

    try:
        return TokenizerAdapter(hf=AutoTokenizer.from_pretrained(str(where)), source=str(where),
                                thinking=cfg.data.thinking if cfg is not None else "keep")
    except (OSError, ValueError) as exc:
        raise EvalError(f"{where}: cannot load a tokenizer ({exc})") from None


# ----------------------------------------------------------------------------- held-out prompts


def heldout_documents(loaded: Loaded, docs: Sequence[Document], tok: TokenizerAdapter) -> tuple[list[Document], str]:
    """(documents the run never trained on, a one-line description of where they come from)."""
    assert loaded.cfg is not None
    return heldout_documents_of(loaded.cfg, docs, tok, loaded.pipeline, loaded.run_dir)


def read_prompts(path: str | Path, tok: TokenizerAdapter) -> list[list[int]]:
    """`.jsonl` lines with "text" (raw prompt) or "messages" (a chat, with its "tools" if any, rendered up to the
    assistant's turn as training renders it), or a text file with one prompt per non-empty line."""
    from dflash import data_formats as fmt

    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"{p}: cannot read prompts ({exc})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if p.suffix != ".jsonl":
            out.append(tok.encode(line))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalError(f"{p}:{n}: not valid JSON ({exc.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            out.append(tok.encode(obj["text"]))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            try:
                msgs = fmt.parse_turns(obj["messages"], "messages", tok.thinking)
                tools = fmt.parse_tools(obj.get("tools"))
            except fmt.RecordError as exc:
                raise EvalError(f"{p}:{n}: {exc}") from None
            out.append(tok.chat_prompt(msgs, tools))
        else:
            raise EvalError(f"{p}:{n}: expected an object with a 'text' string or a 'messages' list")
    if not out or any(not ids for ids in out):
        raise EvalError(f"{p}: no prompts (or an empty one)")
    return out


# ----------------------------------------------------------------------------- measurements


def teacher_forced_accuracy(drafter: DFlashDrafter, target: TargetLM, sequences: Sequence[Sequence[int]],
                            prompt_lens: Sequence[int],
                            serve_anchors: Sequence[Sequence[int]] | None = None,
                            progress: Callable[[int, int], None] | None = None) -> dict[str, list[Any]]:
    """The training path's per-position accuracy (block positions 1..B-1) on `sequences`: target taps of the whole
    sequence, `DFlashDrafter.block_states` (the training forward's states) at anchors on every generated position,
    labels = the sequence itself (the target's greedy tokens after each prompt). What the step event's `acc` would say
    for this checkpoint on this text.

    Returns `all` (every anchor, as training samples them), `counts`, and, given the anchors the decoding used,
    `at_serve_anchors`: the same accuracy restricted to those anchors, which must equal the serve-time match rate
    when serving computes exactly what training does.
    """
    b = drafter.cfg.block_size
    vocab = target.lm_head.weight.shape[0]
    chunk = max(1, 2**26 // ((b - 1) * vocab))  # anchors per pass: bounds the [A, B-1, V] logits
    sums = {key: torch.zeros(b - 1, dtype=torch.float64) for key in ("all_hit", "all_n", "srv_hit", "srv_n")}
    dev = target.device
    for idx, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        n = len(seq)
        if progress is not None:
            progress(1, n)
        if n - 1 <= p:
            continue
        _, taps = target.forward(seq, 0, None, keep=1)
        assert taps is not None
        ids = torch.tensor(seq, dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)
        batch = DraftBatch(hidden=taps, input_ids=ids, loss_mask=pos >= p, position_ids=pos,
                           doc_ids=torch.zeros(n, dtype=torch.long, device=dev))
        served = torch.zeros(n, dtype=torch.bool, device=dev)
        if serve_anchors is not None:
            served[torch.tensor(list(serve_anchors[idx]), dtype=torch.long, device=dev)] = True
        all_anchors = torch.arange(p, n - 1, device=dev)
        k = torch.arange(1, b, device=dev)
        for s in range(0, all_anchors.numel(), chunk):
            anchors = all_anchors[s:s + chunk]
            with torch.no_grad():
                states = drafter.block_states(batch, target.embed_tokens, anchors).reshape(len(anchors), b, -1)
                logits = target.lm_head(states[:, 1:].to(target.lm_head.weight.dtype))
            tgt = anchors[:, None] + k[None, :]
            valid = tgt <= n - 1
            hit = (logits.argmax(-1) == ids[tgt.clamp(max=n - 1)]) & valid
            srv = served[anchors][:, None]
            sums["all_hit"] += hit.sum(0).double().cpu()
            sums["all_n"] += valid.sum(0).double().cpu()
            sums["srv_hit"] += (hit & srv).sum(0).double().cpu()
            sums["srv_n"] += (valid & srv).sum(0).double().cpu()

    def rate(hit: torch.Tensor, cnt: torch.Tensor) -> list[Any]:
        return [round(float(h / c), 4) if c > 0 else None for h, c in zip(hit, cnt, strict=True)]

    out: dict[str, list[Any]] = {"all": rate(sums["all_hit"], sums["all_n"]),
                                 "counts": [int(c) for c in sums["all_n"].tolist()]}
    if serve_anchors is not None:
        out["at_serve_anchors"] = rate(sums["srv_hit"], sums["srv_n"])
    return out


def match_by_position(gens: Sequence[Generation], references: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                      block_size: int) -> list[float | None]:
    """P(draft token at block position j == the committed token at that absolute position (the target's greedy
    token), over every step, whether or not earlier positions matched: the serve-time counterpart of the training
    accuracy at position j."""
    hit = [0] * (block_size - 1)
    tot = [0] * (block_size - 1)
    for g, ref, p in zip(gens, references, prompt_lens, strict=True):
        full = list(ref)
        for a, drafts in zip(g.anchor_pos, g.drafts, strict=True):
            for j, d in enumerate(drafts, 1):
                i = a + j - p  # index into the new tokens
                if i < len(full):
                    tot[j - 1] += 1
                    hit[j - 1] += int(full[i] == d)
    return [round(h / t, 4) if t else None for h, t in zip(hit, tot, strict=True)]


def default_tie_tol(dtype: torch.dtype, device: torch.device | str | None = None) -> float:
    """Relative logit gap under which two tokens are the same argmax up to rounding: a verify forward over a block
    (chunked kernels) and a one-token decode step (recurrent kernels) round differently. True float32: 1e-5 seen on
    logits of 8 on the tiny hybrid target, so 1e-4. bfloat16, or float32 weights under bf16 autocast (`dflash eval`
    on a GPU): 3e-2. float32 on a GPU whose kernels multiply in TF32 (fla's chunked kernels unless
    `exact_float32_kernels` ran first): ~1e-3 per rounding, so 3e-3."""
    if dtype not in (torch.float32, torch.float64):
        return 3e-2
    if device is None:
        return 1e-4
    dev = torch.device(device)
    if dev.type != "cpu" and torch.is_autocast_enabled(dev.type):
        return 3e-2
    return 1e-4 if float32_is_exact(dev) else 3e-3


def logit_gap(target: TargetLM, prefix: Sequence[int], expected: int, got: int) -> tuple[float, float]:
    """From a fresh full forward after `prefix` (no cache: a third rounding path): the logit gap between the two
    tokens, and how far the lower of them sits below the top logit, relative to max(1, |top|)."""
    logits, _ = target.forward(prefix, 0, None, keep=1, taps=False)
    row = logits[-1].float()
    best = float(row.max())
    gap = abs(float(row[expected] - row[got]))
    below = (best - float(min(row[expected], row[got]))) / max(1.0, abs(best))
    return gap, below


def tie_margin(target: TargetLM, prefix: Sequence[int], expected: int | None, got: int | None,
               rel_tol: float) -> float | None:
    """The logit gap between the two tokens after `prefix` from a fresh full forward, if both sit within `rel_tol`
    of the largest logit; None when the difference is a real error (or a length difference, which no rounding
    explains)."""
    if expected is None or got is None:
        return None
    gap, below = logit_gap(target, prefix, expected, got)
    # Both tokens must sit at the top (within the tolerance), not merely close to each other.
    return gap if below <= rel_tol else None


def reference_generations(target: TargetLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          stop_ids: Sequence[int] = (), progress: EvalProgress | None = None) -> list[Generation]:
    """The target's own greedy decoding of every prompt (after one untimed warm-up): the lossless reference and the
    baseline speed. Computed once, it serves evaluations at several block sizes (`evaluate(references=...)`)."""
    target_greedy(target, prompts[0], min(4, max_new_tokens), stop_ids)
    out = []
    if progress is not None:
        progress.phase("target greedy (reference)", len(prompts))
    for prompt in prompts:
        out.append(target_greedy(target, prompt, max_new_tokens, stop_ids))
        if progress is not None:
            progress.advance(1, len(out[-1].tokens))
    return out


def evaluate(target: TargetLM, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             stop_ids: Sequence[int] = (), baseline_ngram: bool = False, train_acc: bool = True,
             tie_tol: float | None = None, references: Sequence[Generation] | None = None,
             progress: EvalProgress | None = None) -> dict[str, Any]:
    """Decode every prompt with the target alone, with DFlash (and prompt lookup); check each output lossless.

    Lossless means token-identical to the target's own greedy decoding, except where the two diverge at a numerical
    tie (both tokens within `tie_tol` of the top logit in a fresh forward): those are listed under `ties`, and the
    rest of that prompt is the target's greedy continuation of the other, equally valid, token.
    """
    param = next(target.model.parameters())
    if tie_tol is None:
        tie_tol = default_tie_tol(param.dtype, param.device)
    b = drafter.cfg.block_size
    dflash = DFlashProposer(drafter, target.embed_tokens, target.lm_head)
    if references is not None and len(references) != len(prompts):
        raise ValueError(f"{len(references)} references for {len(prompts)} prompts")
    refs = list(references) if references is not None else \
        reference_generations(target, prompts, max_new_tokens, stop_ids, progress)
    # Warm-up (allocator, kernel selection) so the first timed prompt is not charged for it.
    speculative_generate(target, dflash, prompts[0], min(2 * b, max_new_tokens), b, stop_ids)
    gens: list[Generation] = []
    ngram: list[Generation] = []
    errors: list[str] = []
    ties: list[dict[str, Any]] = []
    if progress is not None:
        progress.phase("decode: dflash" + (" + n-gram" if baseline_ngram else ""), len(prompts))
    for i, prompt in enumerate(prompts):
        ref = refs[i]
        runs = [("dflash", dflash, gens)] + ([("ngram", NgramProposer(), ngram)] if baseline_ngram else [])
        for name, proposer, sink in runs:
            g = speculative_generate(target, proposer, prompt, max_new_tokens, b, stop_ids)
            sink.append(g)
            if progress is not None:
                progress.advance(int(name == runs[-1][0]), len(g.tokens))
            d = first_difference(ref.tokens, g.tokens)
            if d is None:
                continue
            e = ref.tokens[d] if d < len(ref.tokens) else None
            got = g.tokens[d] if d < len(g.tokens) else None
            margin = tie_margin(target, [*prompt, *ref.tokens[:d]], e, got, tie_tol)
            if margin is not None:  # both are the target's argmax up to rounding: a legitimate divergence
                ties.append({"prompt": i, "method": name, "position": d, "target": e, "speculative": got,
                             "logit_gap": margin})
                continue
            why = ""
            if e is not None and got is not None:
                gap, below = logit_gap(target, [*prompt, *ref.tokens[:d]], e, got)
                why = (f"; a fresh forward puts the two {gap:.3g} apart, the lower {below:.2g} below the top logit "
                       f"(relative), over the tie tolerance {tie_tol:g}")
            errors.append(f"prompt {i} ({name}): output differs from the target's greedy decoding at new token "
                          f"{d} (target {'<end>' if e is None else e}, {name} {'<end>' if got is None else got}){why}")
    new_tokens = sum(len(r.tokens) for r in refs)
    t_target = sum(r.seconds for r in refs)
    t_dflash = sum(g.seconds for g in gens)
    plens = [len(p) for p in prompts]
    stats = acceptance_stats(gens, b)
    result: dict[str, Any] = {
        **stats,
        "method": "decode",
        "block_size": b,
        "lossless": not errors,
        "errors": errors,
        "ties": ties,
        "numerics": {"dtype": str(param.dtype).removeprefix("torch."), "device": param.device.type,
                     "autocast": param.device.type != "cpu" and torch.is_autocast_enabled(param.device.type),
                     "exact_float32": float32_is_exact(param.device), "tie_tol": tie_tol},
        "prompts": len(prompts),
        "prompt_tokens_mean": round(sum(plens) / len(plens), 1),
        "max_new_tokens": max_new_tokens,
        "new_tokens": new_tokens,
        "tokens_per_s": {"target": round(new_tokens / t_target, 2), "dflash": round(new_tokens / t_dflash, 2)},
        "speedup": round(t_target / t_dflash, 3),
        "target_forwards": {"target": sum(r.target_forwards for r in refs),
                            "dflash": sum(g.target_forwards for g in gens)},
        "match_by_position": match_by_position(gens, [g.tokens for g in gens], plens, b),
        "accepted": [g.accepted for g in gens],
    }
    if train_acc:
        seqs = [[*p, *g.tokens] for p, g in zip(prompts, gens, strict=True)]
        if progress is not None:
            progress.phase("training-path accuracy", len(seqs))
        tf = teacher_forced_accuracy(drafter, target, seqs, plens, [g.anchor_pos for g in gens],
                                     progress.advance if progress is not None else None)
        result["train_acc_by_position"] = tf["all"]
        result["train_acc_counts"] = tf["counts"]
        result["train_acc_at_serve_anchors"] = tf["at_serve_anchors"]
    intervals = tau_interval([gens, ngram] if baseline_ngram else [gens])
    result["tau_ci95"] = intervals[0]
    if baseline_ngram:
        t_ngram = sum(g.seconds for g in ngram)
        n_stats = acceptance_stats(ngram, b)
        if stats["tau"] is not None and n_stats["tau"]:
            result["tau_over_ngram"] = {"ratio": round(stats["tau"] / n_stats["tau"], 4), "ci95": intervals[2]}
        result["baseline"] = {"ngram": {
            "tau": n_stats["tau"], "tau_ci95": intervals[1], "steps": n_stats["steps"],
            "accept_hist": n_stats["accept_hist"],
            "accept_by_position": n_stats["accept_by_position"],
            "tokens_per_s": round(new_tokens / t_ngram, 2), "speedup": round(t_target / t_ngram, 3),
            "lossless": not any("(ngram)" in e for e in errors), "accepted": [g.accepted for g in ngram]}}
    return result


def evaluate_teacher_forced(target: TargetLM, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]],
                            max_new_tokens: int, stop_ids: Sequence[int] = (), baseline_ngram: bool = False,
                            sequences: Sequence[Sequence[int]] | None = None,
                            progress: EvalProgress | None = None) -> dict[str, Any]:
    """tau and acceptance exactly as `evaluate` (the decode loop) would measure them, from the target's greedy
    continuations (batched), one target forward per sequence and one drafter pass at every anchor (dflash/tau.py).
    No lossless check and no wall-clock speed: those need the decode loop (`--method decode`)."""
    import time

    from dflash.tau import continuation_length, teacher_forced

    b = drafter.cfg.block_size
    t0 = time.perf_counter()
    if sequences is None and progress is not None:
        progress.phase("target greedy continuations", len(prompts))
    seqs = list(sequences) if sequences is not None else \
        greedy_sequences(target.model, target.device, prompts, continuation_length(max_new_tokens, b),
                         progress=progress.advance if progress is not None else None)
    t_gen = time.perf_counter() - t0
    plens = [len(p) for p in prompts]
    if progress is not None:
        progress.phase("drafter pass (teacher-forced)", len(prompts))

    def taps_of(i: int) -> torch.Tensor:
        _, taps = target.forward(seqs[i], 0, None, keep=1)
        assert taps is not None
        if progress is not None:  # one target forward and one drafter pass per prompt: the batch is the prompt
            progress.advance(1, len(seqs[i]))
        return taps

    gens, ngram, acc = teacher_forced(drafter, target.embed_tokens, target.lm_head, seqs, plens, taps_of,
                                      max_new_tokens, stop_ids, ngram=baseline_ngram)
    param = next(target.model.parameters())
    stats = acceptance_stats(gens, b)
    result: dict[str, Any] = {
        **stats,
        "method": "teacher-forced",
        "block_size": b,
        "numerics": {"dtype": str(param.dtype).removeprefix("torch."), "device": param.device.type,
                     "autocast": param.device.type != "cpu" and torch.is_autocast_enabled(param.device.type),
                     "exact_float32": float32_is_exact(param.device)},
        "prompts": len(prompts),
        "prompt_tokens_mean": round(sum(plens) / len(plens), 1),
        "max_new_tokens": max_new_tokens,
        "new_tokens": sum(len(g.tokens) for g in gens),
        "seconds": {"continuations": round(t_gen, 3), "total": round(time.perf_counter() - t0, 3)},
        "match_by_position": match_by_position(gens, [g.tokens for g in gens], plens, b),
        "train_acc_by_position": acc["all"],
        "train_acc_counts": acc["counts"],
        "train_acc_at_serve_anchors": acc["at_serve_anchors"],
        "accepted": [g.accepted for g in gens],
    }
    intervals = tau_interval([gens, ngram] if ngram is not None else [gens])
    result["tau_ci95"] = intervals[0]
    if ngram is not None:
        n_stats = acceptance_stats(ngram, b)
        if stats["tau"] is not None and n_stats["tau"]:
            result["tau_over_ngram"] = {"ratio": round(stats["tau"] / n_stats["tau"], 4), "ci95": intervals[2]}
        result["baseline"] = {"ngram": {
            "tau": n_stats["tau"], "tau_ci95": intervals[1], "steps": n_stats["steps"],
            "accept_hist": n_stats["accept_hist"], "accept_by_position": n_stats["accept_by_position"],
            "accepted": [g.accepted for g in ngram]}}
    return result


def evaluate_sampled(target: TargetLM, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]],
                     max_new_tokens: int, temperature: float, seed: int = 0, stop_ids: Sequence[int] = (),
                     baseline_ngram: bool = False, draft: str = "sample",
                     progress: EvalProgress | None = None) -> dict[str, Any]:
    """Speculative sampling at `temperature` (dflash.speculative.speculative_sample): tau and speed like `evaluate`.
    No per-prompt lossless check: two correct samplers write different tokens; speculative sampling is lossless in
    distribution, which tests/test_speculative_sampling.py checks (chi-square against the target's own sampling)."""
    from dflash.speculative import sampled_generations

    b = drafter.cfg.block_size
    if progress is not None:  # sampled_generations runs every prompt in one call: one line when it is done
        progress.phase(f"speculative sampling at T={temperature:g}", len(prompts))
    gens = sampled_generations(target, drafter, prompts, max_new_tokens, temperature, seed=seed, stop_ids=stop_ids,
                               baseline_ngram=baseline_ngram, draft=draft)
    if progress is not None:
        progress.advance(len(prompts), sum(len(g.tokens) for run in gens.values() for g in run))
    dfl, ref = gens["dflash"], gens["target"]
    param = next(target.model.parameters())
    plens = [len(p) for p in prompts]
    new_tokens = sum(len(g.tokens) for g in dfl)
    t_target, t_dflash = sum(g.seconds for g in ref), sum(g.seconds for g in dfl)
    stats = acceptance_stats(dfl, b)
    result: dict[str, Any] = {
        **stats, "method": "decode", "temperature": temperature, "draft": draft, "seed": seed, "block_size": b,
        "lossless": None, "lossless_check": "in distribution (tests/test_speculative_sampling.py), not per prompt",
        "errors": [], "ties": [],
        "numerics": {"dtype": str(param.dtype).removeprefix("torch."), "device": param.device.type},
        "prompts": len(prompts), "prompt_tokens_mean": round(sum(plens) / len(plens), 1),
        "max_new_tokens": max_new_tokens, "new_tokens": new_tokens,
        # tokens per second of each method over the tokens it wrote (samples differ in length)
        "tokens_per_s": {"target": round(sum(len(g.tokens) for g in ref) / t_target, 2),
                         "dflash": round(new_tokens / t_dflash, 2)},
        "speedup": round((t_target / max(1, sum(len(g.tokens) for g in ref))) / (t_dflash / max(1, new_tokens)), 3),
        "accepted": [g.accepted for g in dfl],
    }
    ngram = gens.get("ngram")
    intervals = tau_interval([dfl, ngram] if ngram is not None else [dfl])
    result["tau_ci95"] = intervals[0]
    if ngram is not None:
        n_stats = acceptance_stats(ngram, b)
        n_tok, t_ngram = sum(len(g.tokens) for g in ngram), sum(g.seconds for g in ngram)
        if stats["tau"] is not None and n_stats["tau"]:
            result["tau_over_ngram"] = {"ratio": round(stats["tau"] / n_stats["tau"], 4), "ci95": intervals[2]}
        result["baseline"] = {"ngram": {
            "tau": n_stats["tau"], "tau_ci95": intervals[1], "steps": n_stats["steps"],
            "accept_hist": n_stats["accept_hist"], "accept_by_position": n_stats["accept_by_position"],
            "tokens_per_s": round(n_tok / t_ngram, 2),
            "speedup": round((t_target / max(1, sum(len(g.tokens) for g in ref))) / (t_ngram / max(1, n_tok)), 3),
            "lossless": None, "accepted": [g.accepted for g in ngram]}}
    return result


# ----------------------------------------------------------------------------- the command


def render(result: dict[str, Any]) -> None:
    """A short rich table and one acceptance bar per block position. Acceptance (tau, tokens per target verify step)
    and wall-clock speed (tokens/s of the decode loop, `--method decode` only) are separate columns and separate
    summary lines, each named: a method can accept more per step and still be slower per second (a drafter forward
    costs time that prompt lookup does not), and a ratio of one must not be read as the other."""
    from rich.table import Table

    con = _console()
    decode = result.get("method", "decode") == "decode"
    how = result.get("method", "decode") + (f", temperature {result['temperature']:g}" if result.get("temperature")
                                             else "")
    # The headline on its own line: as a table title it would wrap at the (narrow) table's width.
    con.print(f"dflash eval ({how})  B={result['block_size']}  {result['prompts']} prompts  "
              f"{result['new_tokens']} new tokens")
    table = Table()
    cols = ["method", "acceptance τ (tokens/verify step)"] + \
        (["speed (tokens/s, decode loop)", "speed vs target", "lossless"] if decode else [])
    for col in cols:
        table.add_column(col, justify="left" if col == "method" else "right")

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    ng = result.get("baseline", {}).get("ngram")
    if decode:
        tps = result["tokens_per_s"]
        table.add_row("target greedy", "1.00", f"{tps['target']:.1f}", "1.00x", "-")
        sampled = result.get("lossless", True) is None
        table.add_row("dflash", num(result["tau"]), f"{tps['dflash']:.1f}", f"{result['speedup']:.2f}x",
                      "in distribution" if sampled else
                      "yes" if not any("(dflash)" in e for e in result["errors"]) else "[red]NO[/red]")
        if ng:
            table.add_row("n-gram (prompt lookup)", num(ng["tau"]), f"{ng['tokens_per_s']:.1f}",
                          f"{ng['speedup']:.2f}x",
                          "in distribution" if sampled else "yes" if ng["lossless"] else "[red]NO[/red]")
    else:
        table.add_row("dflash", num(result["tau"]))
        if ng:
            table.add_row("n-gram (prompt lookup)", num(ng["tau"]))
    con.print(table)
    for line in headline(result):
        con.print(line, style="dim")
    none = [None] * (result["block_size"] - 1)
    train = result.get("train_acc_by_position") or none
    train_srv = result.get("train_acc_at_serve_anchors") or none
    con.print(f"{'pos':>3}  {'accepted':<27} {'match':>6} {'train':>6} {'train@serve':>11}")
    for j, (acc, match, tr, tr_srv) in enumerate(zip(result["accept_by_position"], result["match_by_position"],
                                                     train, train_srv, strict=True), 1):
        bar = "█" * int(round((acc or 0.0) * 20))
        con.print(f"{j:>3}  [green]{bar:<20}[/green] {_pct(acc)} {_pct(match)} {_pct(tr)} {_pct(tr_srv):>11}")
    con.print("accepted: share of steps accepting the draft at this position; match: the draft equals the target's "
              "token there; train: the training path's accuracy on the same text (all anchors; @serve: the anchors "
              "decoding used, equal to match unless serving and training differ)", style="dim")
    if not decode:
        con.print(f"teacher-forced: exact greedy speculative decoding acceptance from one pass "
                  f"({result['seconds']['total']:.1f} s); wall-clock speed is not measured: --method decode measures "
                  "it and checks lossless", style="dim")
    for e in result.get("errors", []):
        con.print(f"[red]lossless check failed: {e}[/red]")
    for t in result.get("ties", []):
        con.print(f"numerical tie: prompt {t['prompt']} ({t['method']}) diverged at new token {t['position']} "
                  f"(logit gap {t['logit_gap']:.2e}; both tokens are the target's argmax up to rounding)")


def headline(result: dict[str, Any]) -> list[str]:
    """The summary under the table: acceptance (tau with its interval, the dflash / n-gram tau ratio) on one line,
    wall-clock speed (decode loop only) on another, each saying which it is."""
    lines = []
    ng = result.get("baseline", {}).get("ngram")
    ci = result.get("tau_ci95")
    if ci is not None and result["prompts"] > 1:
        line = (f"acceptance τ (tokens per target verify step), 95 % interval over the {result['prompts']} prompts "
                f"(bootstrap): dflash {ci[0]:.2f}-{ci[1]:.2f}")
        ratio = result.get("tau_over_ngram")
        if ng and ng.get("tau_ci95") and ratio and ratio.get("ci95"):
            lo, hi = ng["tau_ci95"]
            line += (f", n-gram {lo:.2f}-{hi:.2f}; τ ratio dflash / n-gram {ratio['ratio']:.2f}x "
                     f"({ratio['ci95'][0]:.2f}-{ratio['ci95'][1]:.2f}): acceptance per step, not speed")
        lines.append(line)
    if result.get("method", "decode") == "decode":
        tps = result["tokens_per_s"]
        speeds = {"target greedy": tps["target"], "dflash": tps["dflash"]}
        line = (f"wall-clock speed (tokens/s of the decode loop): target greedy {tps['target']:.1f}, dflash "
                f"{tps['dflash']:.1f} ({result['speedup']:.2f}x target)")
        if ng and ng.get("tokens_per_s") is not None:
            speeds["n-gram"] = ng["tokens_per_s"]
            line += f", n-gram {ng['tokens_per_s']:.1f} ({ng['speedup']:.2f}x target)"
        lines.append(line + f"; fastest: {max(speeds, key=speeds.__getitem__)}")
    return lines


def _console() -> Any:
    """stdout's console. A terminal gets rich's own width; a pipe or a file gets no width at all (rich would
    otherwise wrap every line at 80 columns), so a long line stays one line for grep and for logs."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            """rich exits 1 when the reader closes the pipe (`dflash eval | head`), which for eval says "not
            lossless": the error goes on to dflash.cli, which ends such a run with the shell's SIGPIPE status."""
            self.quiet = True
            raise BrokenPipeError

    if sys.stdout.isatty():
        return PipeConsole()
    return PipeConsole(width=10_000, soft_wrap=True)


def _pct(v: float | None) -> str:
    return "    -" if v is None else f"{100 * v:5.1f}%"


def _check_length(prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int) -> None:
    """The teacher-forced drafter pass chunks its dense attention to bounded memory down to one anchor per chunk: a
    longer sequence than that allows is refused in one line before the target is loaded (measure.max_eval_tokens)."""
    from dflash.measure import max_eval_tokens
    from dflash.tau import continuation_length

    n, limit = max(len(p) for p in prompts) + continuation_length(max_new_tokens, block_size), max_eval_tokens(block_size)
    if n > limit:
        raise EvalError(f"--max-new-tokens {max_new_tokens}: prompt + new tokens + B-1 = {n} exceed the {limit} tokens "
                        f"the teacher-forced drafter pass can chunk at block size {block_size}; lower it, or use "
                        "--method decode")


def run(args: Any) -> int:
    """The `dflash eval` command; returns the exit code (0 ok, 1 lossless failure, 2 bad input)."""
    from dflash.data import read_documents

    def fail(msg: str) -> int:
        stderr_line(f"dflash eval: {msg}")
        return 2

    if (args.checkpoint is None) == (args.drafter is None):
        return fail("give exactly one of --checkpoint RUN/checkpoints/step-N or --drafter EXPORT_DIR")
    for name in ("num_prompts", "max_new_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.block_size is not None and args.block_size < 2:
        return fail(f"--block-size must be at least 2, got {args.block_size}")
    temperature = float(getattr(args, "temperature", 0.0) or 0.0)
    if temperature < 0:
        return fail(f"--temperature must be >= 0, got {temperature:g}")
    method = getattr(args, "method", None) or ("decode" if temperature > 0 else "teacher-forced")
    if temperature > 0 and method == "teacher-forced":
        return fail("--method teacher-forced gives the exact tau of greedy decoding only; with --temperature > 0 "
                    "use --method decode (speculative sampling)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        loaded = load_checkpoint(args.checkpoint) if args.checkpoint else load_export(args.drafter)
        if args.config is not None:
            loaded.cfg = load_config(args.config)
        if args.block_size is not None:
            loaded.drafter.cfg = dataclasses.replace(loaded.drafter.cfg, block_size=args.block_size)
        # The corpus: held-out prompts come from it, and the tiny BPE is keyed by it.
        need_docs = loaded.cfg is not None and (args.prompts is None or loaded.cfg.data.tokenizer is None)
        docs = read_documents(loaded.cfg.data) if need_docs and loaded.cfg is not None else None
        if args.config is not None and args.target is None:
            loaded.cfg = resolve_pretrained(loaded.cfg, docs)
        tok = load_tokenizer_for(loaded, args.target, docs)
        if args.prompts is not None:
            prompts, where = read_prompts(args.prompts, tok), str(args.prompts)
        else:
            if loaded.cfg is None or docs is None:
                raise EvalError("held-out prompts need the run's config (--config RUN_CONFIG) or pass --prompts FILE")
            held, where = heldout_documents(loaded, docs, tok)
            prompts = prompts_from_documents(held, tok, args.prompt_tokens, loaded.cfg.data.max_len, args.num_prompts)
        prompts = prompts[: args.num_prompts]
        if not prompts:
            raise EvalError(f"no prompt of at least {args.prompt_tokens + 1} tokens in {where}")
        if method == "teacher-forced":
            _check_length(prompts, args.max_new_tokens, loaded.drafter.cfg.block_size)
        target = load_target(loaded, args.target, device)
        loaded.drafter.to(device)
    except (EvalError, ConfigError, DataError) as exc:
        return fail(str(exc))
    stop_ids = [] if args.no_stop else [tok.eos_id]
    # Progress on stderr (a bar on a terminal, plain lines elsewhere): stdout keeps the table or the one JSON object.
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"), EvalProgress() as progress:
        if temperature > 0:
            result = evaluate_sampled(target, loaded.drafter, prompts, args.max_new_tokens, temperature,
                                      seed=getattr(args, "seed", 0), stop_ids=stop_ids,
                                      baseline_ngram=args.baseline == "ngram", draft=getattr(args, "draft", "sample"),
                                      progress=progress)
        elif method == "decode":
            result = evaluate(target, loaded.drafter, prompts, args.max_new_tokens, stop_ids,
                              baseline_ngram=args.baseline == "ngram", tie_tol=args.tie_tol, progress=progress)
        else:
            result = evaluate_teacher_forced(target, loaded.drafter, prompts, args.max_new_tokens, stop_ids,
                                             baseline_ngram=args.baseline == "ngram", progress=progress)
    result = {"source": loaded.source, "prompts_from": where, "device": str(device), **result}
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    if loaded.cfg is not None and longest > loaded.cfg.data.max_len:
        result["warning"] = (f"prompt + new tokens (up to {longest}) exceed data.max_len ({loaded.cfg.data.max_len}): "
                             "the drafter sees positions it never trained on")
    if args.json:
        print(json.dumps(result))
    else:
        render(result)
        print(f"prompts: {where}")
        if "warning" in result:
            print(f"warning: {result['warning']}")
    if result.get("lossless") is False:
        stderr_line(f"dflash eval: {LosslessError.__name__}: {result['errors'][0]}")
        return 1
    return 0
