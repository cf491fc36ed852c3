"""`dflash export --check DIR [--target TARGET_DIR]`: what SGLang and vLLM would misread in a DFlashDraftModel
directory, said before a GPU-day is spent serving it.

Why: both engines load the z-lab layout, but they fail quietly where an export is slightly off (a misnamed tensor is
skipped and left at its random init, a config key one engine reads and the other does not, taps read one layer off),
and the symptom is only a low acceptance length in production. Each rule below names the engine that would misread
the field and cites the loader it comes from (public sources, read as facts; no engine code is copied or imported):

- SGLang `python/sglang/srt/speculative/dflash_utils.py` (`parse_dflash_draft_config`,
  `get_dflash_attention_sliding_window_size`, `DFlashDraftConfig.resolve_target_layer_ids`),
  `python/sglang/srt/models/dflash.py` (`DFlashDraftModel.__init__` / `load_weights`),
  `python/sglang/srt/speculative/dflash_worker.py` (`_resolve_mask_token_id`).
- vLLM `vllm/model_executor/models/qwen3_dflash.py` (`_resolve_layer_attention`, `_dflash_layer_causal`,
  `DFlashQwen3Model`, `DFlashQwen3ForCausalLM.load_weights`), `vllm/config/speculative.py` (method detection,
  draft config), `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py` (`get_eagle3_aux_layers_from_config`: the
  aux layers are `dflash_config.target_layer_ids` + 1 unless `eagle_aux_hidden_state_layer_ids` is set) and the
  target models' forward (`if idx in self.aux_hidden_state_layers: aux.append(hidden_states + residual)` before
  layer `idx` runs, e.g. `vllm/model_executor/models/qwen2.py`, inherited by the Qwen3.5 hybrid).
- z-lab/dflash `dflash/model.py`: the reference reads `hidden_states[id + 1]` for each `target_layer_id`.

The engines' own parsers are not run here: they import CUDA-only packages (triton, flashinfer, vLLM's compiled ops)
at module level, so they cannot be imported on a CPU machine; the rules restate what those functions check or read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The tensors both engines map (SGLang DFlashDraftModel.load_weights, vLLM DFlashQwen3Model's WeightsMapper): nothing
# else may be in model.safetensors (SGLang skips unknown names without a word; vLLM uses an embed_tokens/lm_head it
# finds instead of the target's).
TOP_LEVEL_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
SERVING_DTYPES = ("bfloat16", "float16", "float32")
# How the drafter was trained to mask its block in sliding-window layers (drafter.sliding_block_causal and
# drafter.sliding_window_from), written by `dflash export` for this check. A top-level key of ours that no engine
# reads (vLLM reads is_causal and dflash_config.causal, SGLang is_causal, z-lab's modeling file is_causal): engines
# decide from is_causal alone, this key only lets the check tell whether what they decide is what was trained.
TRAINED_RULE_KEY = "dflash_trained_block_rule"
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
BOTH = "SGLang and vLLM"


@dataclass
class CheckResult:
    """`problems`: one line each, naming the field or tensor and the engine that would misread it (the export must
    not be served). `notes`: what serving needs that is not a defect of the export (an engine flag)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rules: int = 0

    def fail(self, what: str, why: str, engine: str) -> None:
        self.problems.append(f"{what}: {why} ({engine})")


@dataclass
class TargetFacts:
    """What the rules need to know of the target: from --target DIR's config.json, or the checkpoint's meta.json."""

    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    source: str = ""
    tokenizer_vocab: dict[str, int] | None = None


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """name -> {dtype, shape} from the file's JSON header alone (a multi-GB drafter is not read for the check)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(raw, "little")
        if n <= 0 or n > 100 * 2**20:
            raise ValueError(f"header length {n} is not plausible")
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return {k: {"dtype": _ST_DTYPES.get(v["dtype"], v["dtype"]), "shape": list(v["shape"])} for k, v in header.items()}


def target_facts_from_dir(path: str | Path) -> TargetFacts:
    """A local Hugging Face target: its text config (Qwen3.5 nests it under text_config) and tokenizer vocabulary."""
    p = Path(path)
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{p / 'config.json'}: cannot read the target's config ({exc})") from None
    text = raw.get("text_config") or raw
    facts = TargetFacts(num_layers=_int(text.get("num_hidden_layers")), hidden_size=_int(text.get("hidden_size")),
                        vocab_size=_int(text.get("vocab_size")),
                        max_position_embeddings=_int(text.get("max_position_embeddings")),
                        source=str(p / "config.json"))
    tok = p / "tokenizer.json"
    if tok.is_file():
        try:
            model = json.loads(tok.read_text()).get("model") or {}
            vocab = dict(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else {}
            for added in json.loads(tok.read_text()).get("added_tokens") or []:
                vocab[str(added["content"])] = int(added["id"])
            facts.tokenizer_vocab = vocab
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no vocabulary to compare with: that one rule is skipped
    return facts


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_export(path: str | Path, target: TargetFacts | None = None) -> CheckResult:
    """Every rule, on a written export directory; never raises for a bad export (each defect is a problem line)."""
    d = Path(path)
    res = CheckResult()
    cfg_path, st_path = d / "config.json", d / "model.safetensors"
    try:
        cfg = json.loads(cfg_path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        res.fail(str(cfg_path), f"cannot be read ({exc})", BOTH)
        return res
    try:
        tensors = read_safetensors_header(st_path)
    except (OSError, ValueError) as exc:
        res.fail(str(st_path), f"cannot be read ({exc})", BOTH)
        return res
    _check_identity(cfg, d, res)
    dc = _check_dflash_config(cfg, res)
    _check_taps(cfg, dc, target, res)
    _check_mask(cfg, dc, target, res)
    _check_shapes(cfg, target, res)
    _check_attention(cfg, dc, res)
    _check_rope(cfg, target, res)
    _check_tensors(cfg, dc, tensors, res)
    _rule(res)
    try:
        res.problems.extend(check_finite(d))
    except Exception as exc:  # noqa: BLE001 - a file the header reader accepted but safetensors cannot read
        res.fail(str(st_path), f"cannot be read ({type(exc).__name__}: {exc})", BOTH)
    return res


def _rule(res: CheckResult) -> None:
    res.rules += 1


def _check_identity(cfg: dict[str, Any], d: Path, res: CheckResult) -> None:
    _rule(res)
    # vLLM's model registry and SGLang's EntryClass both key on this name; anything else is another model.
    if cfg.get("architectures") != ["DFlashDraftModel"]:
        res.fail("config.json architectures", f"must be [\"DFlashDraftModel\"], got {cfg.get('architectures')!r}",
                 f"{BOTH} pick the model class by it")
    _rule(res)
    # Both engines build the config with transformers' AutoConfig and read Qwen3Config fields (vLLM's
    # DFlashQwen3ForCausalLM is typed on Qwen3Config; SGLang's model reads hidden_size/head_dim/rope off it).
    if cfg.get("model_type") != "qwen3":
        res.fail("config.json model_type", f"must be \"qwen3\" (the Qwen3Config the loaders read), got "
                 f"{cfg.get('model_type')!r}", BOTH)
    _rule(res)
    # transformers' trust_remote_code path (z-lab's reference usage) imports the file auto_map names.
    amap = cfg.get("auto_map") or {}
    for target in amap.values() if isinstance(amap, dict) else []:
        module = str(target).split(".")[0]
        if not (d / f"{module}.py").is_file():
            res.fail(f"config.json auto_map {target}", f"{module}.py is not in the directory",
                     "transformers AutoModel(trust_remote_code=True)")


def _check_dflash_config(cfg: dict[str, Any], res: CheckResult) -> dict[str, Any]:
    _rule(res)
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict):
        res.fail("config.json dflash_config", "missing or not an object: target_layer_ids, mask_token_id and "
                 "block_size live there", f"{BOTH}; vLLM reads target_layer_ids and mask_token_id only from it")
        return {}
    _rule(res)
    # SGLang parse_dflash_draft_config reads dflash_config first, then the top level, for these keys; a top-level
    # copy that disagrees is what another reader (SpecForge, older loaders) takes.
    for key in ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers", "mask_token"):
        if key in dc and key in cfg and dc[key] != cfg[key]:
            res.fail(f"config.json {key}", f"top level {cfg[key]!r} != dflash_config.{key} {dc[key]!r}",
                     "SGLang reads dflash_config, readers of the top level get the other value")
    _rule(res)
    b = dc.get("block_size", cfg.get("block_size"))
    if not _is_int(b) or b < 2:
        res.fail("config.json dflash_config.block_size", f"must be an integer >= 2 (anchor + masks), got {b!r}",
                 "SGLang sizes the draft block from it (default 16 when absent)")
    return dc


def _check_taps(cfg: dict[str, Any], dc: dict[str, Any], target: TargetFacts | None, res: CheckResult) -> None:
    _rule(res)
    taps = dc.get("target_layer_ids")
    if not isinstance(taps, list) or not taps or not all(_is_int(t) for t in taps):
        res.fail("config.json dflash_config.target_layer_ids", f"must be a non-empty list of ints, got {taps!r}",
                 "vLLM falls back to its default aux layers, SGLang to its own spread")
        return
    _rule(res)
    # vLLM captures the residual stream entering each aux layer in layer order (a set lookup), so the concatenation
    # fc reads is ascending and duplicate-free whatever the list says.
    if taps != sorted(set(taps)):
        res.fail("config.json dflash_config.target_layer_ids", f"{taps} must be strictly increasing: the engines "
                 "concatenate the tapped states in layer order, fc was trained on this order", "vLLM")
    _rule(res)
    n = dc.get("num_target_layers", cfg.get("num_target_layers"))
    if not _is_int(n) or n < 1:
        res.fail("config.json num_target_layers", f"missing or not a positive int ({n!r})",
                 "SGLang then range-checks target_layer_ids against the drafter's own num_hidden_layers")
        n = None
    if target is not None and target.num_layers is not None:
        _rule(res)
        if n is not None and n != target.num_layers:
            res.fail("config.json num_target_layers", f"{n} != the target's {target.num_layers} layers "
                     f"({target.source})", f"{BOTH}: taps would be read from another model")
        n = target.num_layers
    if n is None:
        return
    _rule(res)
    for t in taps:
        if not 0 <= t < n:  # SGLang DFlashDraftConfig.resolve_target_layer_ids raises on this
            res.fail("config.json dflash_config.target_layer_ids", f"layer {t} is outside 0..{n - 1}", "SGLang")
        elif t + 1 >= n:
            # hidden_states[id + 1] convention: vLLM taps layer id + 1's input (eagle3_utils adds 1; the target's
            # forward appends hidden_states + residual before running layer idx), SGLang likewise captures "before
            # layer i" with +1; the output of the last layer is never captured (it is not any layer's input).
            res.fail("config.json dflash_config.target_layer_ids", f"layer {t} is the target's last: engines read "
                     f"the input of layer id+1 = {t + 1}, which does not exist", BOTH)
    _rule(res)
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and list(aux) != [t + 1 for t in taps]:
        # vLLM get_eagle3_aux_layers_from_config takes this key first and as is, without the +1.
        res.fail("config.json eagle_aux_hidden_state_layer_ids", f"{aux} overrides target_layer_ids + 1 = "
                 f"{[t + 1 for t in taps]}", "vLLM")


def _check_mask(cfg: dict[str, Any], dc: dict[str, Any], target: TargetFacts | None, res: CheckResult) -> None:
    _rule(res)
    m = dc.get("mask_token_id")
    if not _is_int(m) or m < 0:
        # vLLM DFlashQwen3Model reads dflash_config.mask_token_id; SGLang without it looks the mask token up in the
        # tokenizer and adds it when missing (an id past the embedding: refused) — a different token than trained.
        res.fail("config.json dflash_config.mask_token_id", f"must be a non-negative int, got {m!r}", BOTH)
        return
    vocab = _int(cfg.get("vocab_size"))
    if target is not None and target.vocab_size is not None:
        vocab = target.vocab_size
    if vocab is not None:
        _rule(res)
        if m >= vocab:  # SGLang _resolve_mask_token_id raises; vLLM embeds it from the target's embedding table
            res.fail("config.json dflash_config.mask_token_id", f"{m} is not below the target's vocabulary "
                     f"({vocab} embedding rows)", f"{BOTH}: the mask embedding is a row of the target's table")
    if target is not None and target.tokenizer_vocab is not None:
        _rule(res)
        name = dc.get("mask_token", cfg.get("mask_token")) or "<|MASK|>"  # SGLang's DEFAULT_DFLASH_MASK_TOKEN
        tid = target.tokenizer_vocab.get(str(name))
        if tid is not None and tid != m:
            res.fail("config.json dflash_config.mask_token_id", f"{m} but the target tokenizer has {name!r} at "
                     f"{tid}", "SGLang refuses the conflict (set dflash_config.mask_token to the trained token)")


def _check_shapes(cfg: dict[str, Any], target: TargetFacts | None, res: CheckResult) -> None:
    _rule(res)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size"):
        v = cfg.get(key)
        if not _is_int(v) or v < 1:
            # SGLang/vLLM fall back to hidden_size // num_attention_heads for a missing head_dim (Qwen3 drafters
            # have head_dim 128 != hidden / heads) and build every other module from these.
            res.fail(f"config.json {key}", f"missing or not a positive int ({v!r})", BOTH)
    h, nh, nkv = cfg.get("hidden_size"), cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if _is_int(nh) and _is_int(nkv) and nkv > 0 and nh % nkv:
        res.fail("config.json num_key_value_heads", f"{nh} attention heads are not a multiple of {nkv} kv heads",
                 BOTH)
    _rule(res)
    th = cfg.get("target_hidden_size")
    if th is not None and th != h:  # vLLM _get_dflash_fc_input_size sizes fc from target_hidden_size
        res.fail("config.json target_hidden_size", f"{th} != hidden_size {h}: the drafter shares the target's "
                 "embedding, so both are the target's width", "vLLM")
    _rule(res)
    dv = cfg.get("draft_vocab_size")
    if dv is not None and dv != cfg.get("vocab_size"):
        res.fail("config.json draft_vocab_size", f"{dv} != vocab_size {cfg.get('vocab_size')}: vLLM then expects a "
                 "d2t token map this export does not have", "vLLM")
    if target is not None:
        _rule(res)
        if target.hidden_size is not None and h != target.hidden_size:
            res.fail("config.json hidden_size", f"{h} != the target's {target.hidden_size} ({target.source})",
                     f"{BOTH}: the drafter runs on the target's embedding and LM head")
        _rule(res)
        if target.vocab_size is not None and cfg.get("vocab_size") != target.vocab_size:
            # DFlashQwen3ForCausalLM: draft_vocab_size defaults to vocab_size; != target's => a draft->target id map
            res.fail("config.json vocab_size", f"{cfg.get('vocab_size')} != the target's {target.vocab_size}: vLLM "
                     "maps draft ids through a d2t table this export does not have", "vLLM")
    _rule(res)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":  # SGLang DFlashMLP refuses others; vLLM would build the MLP with it, not what was trained
        res.fail("config.json hidden_act", f"must be \"silu\" (the trained MLP), got {act!r}", BOTH)
    _rule(res)
    if cfg.get("attention_bias"):
        res.fail("config.json attention_bias", "true, but the export has no bias tensors (they would stay at their "
                 "initial value)", BOTH)


def _check_attention(cfg: dict[str, Any], dc: dict[str, Any], res: CheckResult) -> None:
    n = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types")
    _rule(res)
    if types is not None:
        if not isinstance(types, list) or (_is_int(n) and len(types) != n):
            # SGLang _get_dflash_layer_attention_params: one entry per draft layer
            res.fail("config.json layer_types", f"must list one type per layer ({n}), got {types!r}", "SGLang")
            types = None
        elif any(t not in ("full_attention", "sliding_attention") for t in types):
            res.fail("config.json layer_types", f"only full_attention / sliding_attention exist, got {types}",
                     "SGLang refuses other types")
            types = None
    sliding = [i for i, t in enumerate(types or []) if t == "sliding_attention"]
    w = cfg.get("sliding_window")
    _rule(res)
    if sliding:
        if not _is_int(w) or w < 1:
            # SGLang get_dflash_attention_sliding_window_size raises; vLLM _resolve_layer_attention too
            res.fail("config.json sliding_window", f"layers {sliding} are sliding_attention but sliding_window is "
                     f"{w!r}", BOTH)
        if cfg.get("use_sliding_window") is not True:
            # transformers' Qwen3Config sets sliding_window to None when use_sliding_window is false, so both
            # engines (which read the AutoConfig) lose the window.
            res.fail("config.json use_sliding_window", "must be true when layer_types has sliding_attention "
                     "(transformers' Qwen3Config drops sliding_window otherwise)", BOTH)
        if _is_int(w):
            res.notes.append(f"sliding layers {sliding}: SGLang and vLLM apply the window per query position (a query "
                             f"at q reads keys in [q-{w}+1, q]) and, with is_causal false, the block bidirectionally, "
                             "without is_causal causally: dflash trains either (drafter.sliding_block_causal); "
                             "speculators counts the window from the anchor, which no engine serves")
        if len(sliding) < len(types or []):
            res.notes.append(f"layer_types mixes sliding and full attention (sliding: {sliding}): vLLM serves it only "
                             "with the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)")
    elif cfg.get("use_sliding_window"):
        res.fail("config.json use_sliding_window", "true but no layer is sliding_attention", BOTH)
    _rule(res)
    swa = dc.get("swa_window_size")
    if swa is not None and swa != w:  # vLLM takes dflash_config.swa_window_size before sliding_window; SGLang not
        res.fail("config.json dflash_config.swa_window_size", f"{swa} != sliding_window {w}",
                 "vLLM reads swa_window_size, SGLang sliding_window")
    _rule(res)
    if dc.get("use_swa") and len(sliding) != len(types or [1]):
        res.fail("config.json dflash_config.use_swa", "forces sliding attention on every layer", "vLLM")
    _check_causal(cfg, dc, sliding, res)


def served_causal_layers(cfg: dict[str, Any]) -> list[int]:
    """The layers whose block the engines run causal (a query reads only the block tokens up to itself): vLLM's
    `_dflash_layer_causal` (is_causal, then dflash_config.causal, then causal iff the layer is sliding_attention),
    SGLang's `_get_dflash_layer_attention_params` (is_causal, else sliding_attention layers causal) and z-lab's
    modeling file agree on it for every config `dflash export` writes."""
    n = int(cfg.get("num_hidden_layers") or 0)
    types = cfg.get("layer_types") or ["full_attention"] * n
    if cfg.get("is_causal") is not None:
        return list(range(n)) if cfg.get("is_causal") else []
    if (cfg.get("dflash_config") or {}).get("causal") is not None:
        return list(range(n)) if cfg["dflash_config"]["causal"] else []
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def trained_block_rule(cfg: dict[str, Any]) -> tuple[bool, str]:
    """(sliding_block_causal, sliding_window_from) the export says it was trained with (TRAINED_RULE_KEY); an export
    without the key (an older dflash export, a drafter from elsewhere) counts as trained bidirectionally per query."""
    rule = cfg.get(TRAINED_RULE_KEY)
    rule = rule if isinstance(rule, dict) else {}
    return bool(rule.get("sliding_block_causal", False)), str(rule.get("sliding_window_from", "query"))


def _check_causal(cfg: dict[str, Any], dc: dict[str, Any], sliding: list[int], res: CheckResult) -> None:
    """Whether the engines mask the block in each layer as it was trained: bidirectionally everywhere (is_causal
    false), or causal in the sliding layers only (drafter.sliding_block_causal: is_causal absent, the engines' own
    default for sliding_attention layers)."""
    causal, window_from = trained_block_rule(cfg)
    _rule(res)
    if sliding and window_from != "query":
        res.fail(f"config.json {TRAINED_RULE_KEY}.sliding_window_from", f"{window_from!r}: trained with the window "
                 "counted from the anchor (speculators' rule), which no engine applies: they count it per query "
                 "position", BOTH)
    _rule(res)
    if causal and sliding:
        if cfg.get("is_causal") is not None:
            res.fail("config.json is_causal", f"must be absent: the drafter was trained with its sliding layers "
                     f"{sliding} causal inside the block, which the engines run only without is_causal "
                     f"({cfg.get('is_causal')!r} makes " + ("every layer causal)" if cfg.get("is_causal") else
                                                            "them bidirectional)"), BOTH)
        if dc.get("causal") is not None:
            res.fail("config.json dflash_config.causal", f"{dc.get('causal')!r} overrides the per-layer rule on every "
                     "layer (the drafter was trained causal in its sliding layers only)", "vLLM")
        if served_causal_layers(cfg) == sliding:
            res.notes.append(f"sliding layers {sliding}: is_causal is absent, so vLLM, SGLang and z-lab's modeling run "
                             "them causal inside the block, which is what this drafter was trained for "
                             "(drafter.sliding_block_causal)")
        return
    # Trained bidirectionally on every layer: only an explicit is_causal false says so to every engine (vLLM
    # _dflash_layer_causal and SGLang make sliding layers causal without it).
    if cfg.get("is_causal") is not False:
        res.fail("config.json is_causal", f"must be false (the block attends to itself bidirectionally), got "
                 f"{cfg.get('is_causal')!r}", "vLLM" + (" makes the sliding layers causal" if sliding and
                                                          "is_causal" not in cfg else ""))
    if dc.get("causal"):
        res.fail("config.json dflash_config.causal", "true overrides is_causal on every layer", "vLLM")


def _check_rope(cfg: dict[str, Any], target: TargetFacts | None, res: CheckResult) -> None:
    _rule(res)
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")
    ptheta = params.get("rope_theta") if isinstance(params, dict) else None
    # vLLM passes config.rope_parameters to get_rope (default theta 1e6 when absent); SGLang get_rope_config; the
    # two spellings must say the same.
    if ptheta is None and theta is None:
        res.fail("config.json rope_theta", "missing: engines assume 1e6", BOTH)
    elif ptheta is not None and theta is not None and float(ptheta) != float(theta):
        res.fail("config.json rope_parameters.rope_theta", f"{ptheta} != rope_theta {theta}", BOTH)
    _rule(res)
    rtype = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    scaling = cfg.get("rope_scaling")
    stype = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if rtype != "default" or stype not in (None, "default"):
        res.fail("config.json rope_parameters", f"rope type {rtype if rtype != 'default' else stype!r}: the drafter "
                 "was trained with plain RoPE, the engines would apply the scaling", BOTH)
    _rule(res)
    for key in ("is_neox_style", "rope_is_neox_style"):
        if cfg.get(key, True) is not True:  # the trained RoPE is rotate-half (neox); engines honour this key
            res.fail(f"config.json {key}", "must be true (rotate-half RoPE, as trained)", BOTH)
    if target is not None and target.max_position_embeddings is not None:
        _rule(res)
        mpe = cfg.get("max_position_embeddings")
        if _is_int(mpe) and mpe < target.max_position_embeddings:
            res.fail("config.json max_position_embeddings", f"{mpe} < the target's {target.max_position_embeddings}: "
                     "the drafter's RoPE cache is sized from it", BOTH)


def _check_tensors(cfg: dict[str, Any], dc: dict[str, Any], tensors: dict[str, dict[str, Any]],
                   res: CheckResult) -> None:
    n = cfg.get("num_hidden_layers") if _is_int(cfg.get("num_hidden_layers")) else 0
    wanted = [*TOP_LEVEL_TENSORS, *(f"layers.{i}.{k}" for i in range(n) for k in LAYER_TENSORS)]
    _rule(res)
    for name in wanted:
        if name not in tensors:
            res.fail(f"model.safetensors {name}", "missing: the module keeps its random initial value", BOTH)
    _rule(res)
    for name in sorted(set(tensors) - set(wanted)):
        if "embed_tokens" in name or "lm_head" in name:
            why = "vLLM then uses it instead of the target's embedding / LM head"
        elif name.startswith("model."):
            why = "prefixed names are remapped differently by each engine (SGLang strips model., vLLM adds it)"
        else:
            why = "not a DFlash tensor: SGLang skips unknown names without a word, vLLM refuses them"
        res.fail(f"model.safetensors {name}", f"unexpected ({why})", BOTH)
    h, nh, nkv, hd, inter = (cfg.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                   "head_dim", "intermediate_size"))
    k = len(dc.get("target_layer_ids") or [])
    if all(_is_int(v) for v in (h, nh, nkv, hd, inter)):
        _rule(res)
        want: dict[str, list[int]] = {"fc.weight": [h, k * h], "hidden_norm.weight": [h], "norm.weight": [h]}
        for i in range(n):
            p = f"layers.{i}."
            want.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                         p + "self_attn.q_proj.weight": [nh * hd, h], p + "self_attn.k_proj.weight": [nkv * hd, h],
                         p + "self_attn.v_proj.weight": [nkv * hd, h], p + "self_attn.o_proj.weight": [h, nh * hd],
                         p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
                         p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
                         p + "mlp.down_proj.weight": [h, inter]})
        for name, shape in want.items():
            got = tensors.get(name, {}).get("shape")
            if got is not None and got != shape:
                # SGLang raises on fc.weight (K taps x hidden); every other mismatch fails in a weight loader
                engine = "SGLang refuses fc.weight's shape; vLLM sizes fc from the taps" if name == "fc.weight" \
                    else BOTH
                res.fail(f"model.safetensors {name}", f"shape {got} but config.json implies {shape}", engine)
    _rule(res)
    dtypes = sorted({t["dtype"] for t in tensors.values()})
    if len(dtypes) > 1 or (dtypes and dtypes[0] not in SERVING_DTYPES):
        res.fail("model.safetensors dtypes", f"{dtypes}: one of {list(SERVING_DTYPES)} expected (an unquantized "
                 "drafter; the engines cast it to the target's dtype)", BOTH)
    _rule(res)
    declared = cfg.get("dtype", cfg.get("torch_dtype"))
    if dtypes and len(dtypes) == 1 and declared != dtypes[0]:
        res.fail("config.json dtype", f"{declared!r} but the weights are {dtypes[0]}",
                 "transformers from_pretrained(dtype=\"auto\") and engines on --dtype auto")


def check_finite(path: str | Path) -> list[str]:
    """Tensors holding NaN or inf (every engine would draft garbage from them); reads the weights."""
    from safetensors import safe_open

    bad = []
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118 - safe_open is not a dict
            t = fh.get_tensor(name)
            if t.is_floating_point() and not bool(t.float().isfinite().all()):
                bad.append(f"model.safetensors {name}: holds NaN or inf ({BOTH} would draft garbage)")
    return bad


def render(res: CheckResult, where: str) -> str:
    """The verdict line for a passing export (problems are printed one per line by the caller)."""
    return f"{where}: passes {res.rules} SGLang/vLLM loader checks" if not res.problems else \
        f"{where}: {len(res.problems)} problem(s); SGLang/vLLM would misread this export"


__all__ = ["TRAINED_RULE_KEY", "CheckResult", "TargetFacts", "check_export", "check_finite",
           "read_safetensors_header", "served_causal_layers", "target_facts_from_dir", "trained_block_rule", "render"]
