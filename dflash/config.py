"""The run configuration of `dflash train`: pydantic models loaded from YAML, every field and invariant checked once.

A typo or a wrong value fails at once with `ConfigError` (`FILE:LINE: field.path: what`) before anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from dflash import yamlfile
from dflash.drafter_config import DrafterConfig
from dflash.target_config import (
    ATTENTIONS,
    CUDA_GRAPHS,
    DEFAULT_FAMILY,
    DTYPE_NAMES,
    FAMILIES,
    FUSED_ELEMENTWISE,
    PACKINGS,
    TargetConfig,
    check_arch,
)

# Nothing here imports torch (dflash/drafter_config.py, dflash/target_config.py): the CLI checks a config file in
# well under a second, before it imports torch; check_run imports dflash.target when it needs the target's shape.

EMPTY_HINT = "empty config (see configs/tiny.yaml for a complete one)"
_ATTENTION = ("auto", "flex", "dense", "flex-eager")


class ConfigError(ValueError):
    """A config problem, already phrased as the one line the CLI prints (`FILE:LINE: a.b: what is wrong`); a file
    with several problems gives one such line each (`problems`; the message is those lines)."""

    def __init__(self, msg: str, problems: list[str] | None = None) -> None:
        super().__init__(msg)
        self.problems = problems or [msg]


class FieldProblem(ValueError):
    """Raised by a validator that knows the full field path (cross-field rules): the error names that field."""

    def __init__(self, path: str, msg: str) -> None:
        super().__init__(msg)
        self.path = path


# ---------------------------------------------------------------------------------------------- field rules
def _describe(value: Any) -> str:
    return repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def _kinds(annotation: Any) -> set[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {a for a in typing.get_args(annotation) if a is not type(None)}
    return {annotation}


def _strict_scalar(value: Any, annotation: Any) -> Any:
    """Pydantic's lax mode would read `"3"` or `true` as numbers and `1` as true; a config typo must not pass like
    that. An integral float is an integer (`max_chars: 1e6`)."""
    kinds = _kinds(annotation)
    if value is None:
        return value
    if bool in kinds and str in kinds:  # a switch with a word (drafter.grad_checkpoint: auto): its own validator
        if not isinstance(value, (bool, str)):
            raise ValueError(f"expected true, false or a word, got {_describe(value)}")
    elif bool in kinds:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {_describe(value)}")
    elif int in kinds and float not in kinds:
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {_describe(value)}")
    elif float in kinds:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {_describe(value)}")
    elif str in kinds and not isinstance(value, str):
        raise ValueError(f"expected a string, got {_describe(value)}")
    elif typing.get_origin(annotation) is list or list in {typing.get_origin(k) for k in kinds}:
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {_describe(value)}")
    elif typing.get_origin(annotation) is dict or dict in {typing.get_origin(k) for k in kinds}:
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping, got {_describe(value)}")
    return value


def _strict_field(cls: Any, value: Any, info: ValidationInfo) -> Any:
    field = cls.__pydantic_fields__.get(info.field_name)
    return value if field is None else _strict_scalar(value, field.annotation)


def _at_least(n: int | float, what: str = "at least") -> Any:
    def check(v: Any) -> Any:
        if v is not None and not v >= n:
            raise ValueError(f"must be {what} {n}, got {v}")
        return v

    return check


def _positive(v: Any) -> Any:
    if not v > 0:
        raise ValueError(f"must be positive, got {v}")
    return v


def _one_of(*options: str) -> Any:
    def check(v: Any) -> Any:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {_describe(v)}")
        return v

    return check


def _v(fn: Any, *fields: str) -> Any:
    """A field validator from a plain check function (the rules above are shared by several fields)."""
    return field_validator(*fields)(lambda cls, v: fn(v))


_STRICT = field_validator("*", mode="before")(_strict_field)


# ---------------------------------------------------------------------------------------------- sections
class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=False)
    _strict = _STRICT


class DataConfig(_Section):
    # Files or directories of `.txt` / `.jsonl`; empty = the embedded default corpus (Python's own stdlib sources).
    paths: list[str] = []
    # auto | text | chat (OpenAI `messages`, tool turns too) | sharegpt (`conversations`); docs/data.md
    format: str = "auto"
    text_field: str = "text"  # the record key (dataset column) holding plain text
    messages_field: str | None = None  # the key holding a chat; None: `messages`, then `conversations`
    thinking: str = "drop"  # keep | drop: Qwen3-style <think>...</think> / reasoning_content of assistant turns
    # A local Hugging Face tokenizer directory, or None for the tiny byte-level BPE trained on the corpus.
    tokenizer: str | None = None
    vocab_size: int = 2048  # only for the tiny BPE
    tokenizer_cache: str | None = None  # where the tiny BPE is cached; default OUT/tokenizer
    max_len: int = 256  # longest document piece in tokens; longer documents are split
    min_len: int = 8  # shorter pieces are dropped (nothing to anchor on)
    token_budget: int = 2048  # tokens per hidden-state buffer (fixed shape of every drafter step)
    num_buckets: int = 8  # length buckets for packing
    reservoir: int = 4  # drafter-side buffers mixed at random
    max_chars: int = 1_500_000  # cap of the embedded corpus (keeps the tiny run fast)

    _format = _v(_one_of("auto", "text", "chat", "sharegpt"), "format")
    _thinking = _v(_one_of("keep", "drop"), "thinking")

    @field_validator("text_field", "messages_field")
    @classmethod
    def _field_name(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must name a record key (column), got an empty string")
        return v
    _max_len = _v(_at_least(2), "max_len")
    _counts = _v(_at_least(1), "reservoir", "num_buckets")


class TrainConfig(_Section):
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.1  # cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.01
    betas: list[float] = [0.9, 0.95]
    # adamw, or muon: Muon (torch.optim.Muon, match_rms_adamw) on the drafter's 2-D weights + AdamW on the rest
    # (speculators' default for DFlash); muon_weight_decay is the Muon group's (speculators: 0.1)
    optimizer: str = "adamw"
    muon_weight_decay: float = 0.1
    grad_clip: float = 1.0
    epochs: int = 1
    max_steps: int | None = None  # when set, the run length (more epochs are scheduled if one is not enough)
    seed: int = 0
    checkpoint_every: int = 100  # steps; 0 = only at the end / on a signal
    keep_last: int = 3
    # The final checkpoint on a full disk: retry for this long (a periodic one is skipped; training goes on).
    final_save_wait_s: float = 600.0
    heartbeat_s: float = 5.0
    log_every: int = 1
    compile: str = "auto"  # auto (GPU only) | true | false
    compile_backend: str = "inductor"  # torch.compile backend ("eager"/"aot_eager" check tracing without codegen)
    # What train.compile compiles: the whole drafter step, or its repeated units (one decoder layer, one CE chunk)
    # once each, reused by every layer: a cold first step that does not grow with the depth (docs/warm-start.md).
    compile_scope: str = "whole"
    # The drafter's exact serving tau on a held-out set (the `eval` event, docs/events.md): every this many steps and
    # at the end; None = at every checkpoint (checkpoint_every), 0 = off.
    eval_every: int | None = None
    eval_prompts: int = 32  # held-out prompts (the same ones `dflash eval --num-prompts N` picks)
    eval_prompt_tokens: int | None = None  # None: target.regen's prompt_tokens, else data.max_len // 4 (<= 256)
    eval_new_tokens: int | None = None  # None: target.regen's max_new_tokens, else up to 128
    # A z-lab-layout drafter directory (`dflash export`, a released DFlash drafter) whose weights replace the random
    # init of a new run (dflash/init_from.py; `dflash train --init-from DIR`); a resumed run loads its checkpoint.
    init_from: str | None = None

    _positive = _v(_positive, "lr", "heartbeat_s")
    _counts = _v(_at_least(1), "epochs", "max_steps", "keep_last", "log_every", "eval_prompts",
                 "eval_prompt_tokens", "eval_new_tokens")
    _every = _v(_at_least(0, ">="), "checkpoint_every", "final_save_wait_s", "eval_every")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_bool(cls, v: Any) -> Any:
        return str(v).lower() if isinstance(v, bool) else v  # YAML reads `compile: true` as a bool

    _compile = _v(_one_of("auto", "true", "false"), "compile")
    _compile_scope = _v(_one_of("whole", "regional"), "compile_scope")
    _optimizer = _v(_one_of("adamw", "muon"), "optimizer")
    _muon_wd = _v(_at_least(0, ">="), "muon_weight_decay")

    @field_validator("warmup_frac")
    @classmethod
    def _warmup(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"must be in [0, 1), got {v}")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2:
            raise ValueError(f"must be two numbers, got {v}")
        return v


class DistConfig(_Section):
    # colocated: every rank runs target + drafter. split: the last `target_ranks` ranks run the target,
    # the first ones train the drafter (DDP among them), so rank 0 always has the loss.
    roles: str = "colocated"
    # None: the split that balances the measured per-step times (dflash.pipeline.balanced_target_ranks, 5 of 8 at
    # the 27B shape); set it to override.
    target_ranks: int | None = None
    # Several nodes (torchrun --nnodes > 1): left out, every node runs its own balanced split (the last t local ranks
    # run the target for that node's drafters; hidden states stay on the node); set it to choose t. target_ranks
    # instead places that many target ranks at the end of the whole job.
    target_ranks_per_node: int | None = None
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | gloo | nccl
    # How long one collective or send/recv may wait for its peers before the rank fails with the operation named
    # (torchrun then stops the job, and opsctl reports a crash with that reason) instead of hanging silently. It must
    # cover the longest wait of a healthy run: a drafter waits for its target's first forward (kernel compile included)
    # and for rank 0's checkpoint writes.
    timeout_s: float = 1800.0

    _roles = _v(_one_of("colocated", "split"), "roles")
    _backend = _v(_one_of("auto", "gloo", "nccl"), "backend")
    _ranks = _v(_at_least(1), "target_ranks")
    _ranks_node = _v(_at_least(1), "target_ranks_per_node")
    _timeout = _v(_at_least(1), "timeout_s")


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class TargetSection(TargetConfig):
    """target.* as loaded from YAML; a TargetConfig, so dflash/target.py takes it as it is."""

    _strict = _STRICT
    _dtype = _v(_one_of("auto", *DTYPE_NAMES), "dtype")
    _packing = _v(_one_of(*PACKINGS), "packing")
    _attention = _v(_one_of(*ATTENTIONS), "attention")
    _cuda_graph = _v(_one_of(*CUDA_GRAPHS), "cuda_graph")
    _fused = _v(_one_of(*FUSED_ELEMENTWISE), "fused_elementwise")

    _family = _v(_one_of(*FAMILIES), "family")

    @field_validator("arch")
    @classmethod
    def _arch(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        try:
            check_arch(info.data.get("family", DEFAULT_FAMILY), v, keys=not (info.context or {}).get("quick"))
        except ValueError as exc:  # `target.arch.KEY: what`
            path, _, msg = str(exc).partition(": ")
            raise FieldProblem(path, msg) from None
        return v


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class DrafterSection(DrafterConfig):
    """drafter.* as loaded from YAML; a DrafterConfig, so dflash/model.py takes it as it is."""

    _strict = _STRICT
    _attention = _v(_one_of(*_ATTENTION), "attention")
    _weights = _v(_one_of("exp", "dpace", "uniform"), "position_weights")
    _sampling = _v(_one_of("buffer", "document"), "anchor_sampling")
    _window_from = _v(_one_of("query", "anchor"), "sliding_window_from")
    _counts = _v(_at_least(1, ">="), "num_layers", "num_heads", "num_kv_heads", "ce_chunk", "hidden_size", "head_dim",
                 "intermediate_size", "sliding_window")
    _block = _v(_at_least(2, ">="), "block_size")
    _mask = _v(_at_least(0, ">="), "mask_token_id")

    @field_validator("grad_checkpoint", mode="before")
    @classmethod
    def _grad_checkpoint(cls, v: Any) -> Any:
        if v is True or v is False or v == "auto":
            return v
        raise ValueError(f"expected true, false or auto, got {_describe(v)}")

    @field_validator("loss_gamma")
    @classmethod
    def _gamma(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator("dpace_alpha")
    @classmethod
    def _alpha(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v


class RunConfig(BaseModel):
    """The whole run. `source` (the file) and `lines` (key path -> line) are not YAML keys: errors found after
    loading still name the line."""

    model_config = ConfigDict(extra="forbid")

    target: TargetSection = TargetSection()
    drafter: DrafterSection = DrafterSection()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    dist: DistConfig = DistConfig()
    _source: str | None = PrivateAttr(None)
    _lines: dict[tuple[str, ...], int] = PrivateAttr(default_factory=dict)
    _checked: str | None = PrivateAttr(None)  # what check_run last passed (see there)

    @property
    def source(self) -> str | None:
        return self._source

    @property
    def lines(self) -> dict[tuple[str, ...], int]:
        return self._lines

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """`train:` with every key commented out is YAML null: the section's defaults, as before."""
        if isinstance(data, dict):
            return {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> RunConfig:
        """The rules that relate two fields; each is here and nowhere else."""

        def need(ok: bool, path: str, msg: str) -> None:
            if not ok:
                raise FieldProblem(path, msg)

        d, r = self.data, self.drafter
        need(d.token_budget >= d.max_len, "data.token_budget",
             f"must be at least data.max_len ({d.max_len}), got {d.token_budget}")
        need(1 <= d.min_len <= d.max_len, "data.min_len", f"must be in 1..data.max_len ({d.max_len}), got {d.min_len}")
        need(r.num_heads % r.num_kv_heads == 0, "drafter.num_heads",
             f"must be a multiple of drafter.num_kv_heads ({r.num_kv_heads}), got {r.num_heads}")
        # Anchors are drawn without replacement from the token_budget positions of one fixed-shape buffer.
        need(1 <= r.num_anchors <= d.token_budget, "drafter.num_anchors",
             f"must be in 1..data.token_budget ({d.token_budget}), got {r.num_anchors}")
        if r.layer_sliding_windows is not None:
            need(len(r.layer_sliding_windows) == r.num_layers, "drafter.layer_sliding_windows",
                 f"needs drafter.num_layers ({r.num_layers}) entries, got {len(r.layer_sliding_windows)}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="python")

    def error(self, exc_or_msg: Exception | str) -> ConfigError:
        """`FIELD: message` -> a ConfigError `FILE:LINE: FIELD: message`, the line looked up in the loaded file."""
        msg = str(exc_or_msg)
        path, _, what = msg.partition(": ")
        return _error(self.source or "<config>", self.lines, path, what) if what and " " not in path else \
            ConfigError(f"{self.source or '<config>'}: {msg}")


def _line(lines: dict[tuple[str, ...], int], path: str) -> int | None:
    loc = tuple(p for p in path.replace("[", ".").replace("]", "").split(".") if p)
    return yamlfile.line_for(lines, loc) if loc else None


def _error(source: str, lines: dict[tuple[str, ...], int], path: str, msg: str) -> ConfigError:
    return ConfigError(yamlfile.format_problem(source, _line(lines, path), path, msg))


_TYPE_MESSAGES = {"int": "expected an integer", "float": "expected a number", "bool": "expected true or false",
                  "string": "expected a string", "list": "expected a list", "dict": "expected a mapping",
                  "model": "expected a mapping", "dataclass": "expected a mapping"}


def _problem(e: Any) -> tuple[str, str]:
    """(dotted field path, message) of one pydantic error, phrased as the rest of this module phrases them."""
    loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
    path = ""
    for p in loc:
        path += f"[{p}]" if isinstance(p, int) else (f".{p}" if path else str(p))
    cause = (e.get("ctx") or {}).get("error")
    if isinstance(cause, FieldProblem):
        return cause.path, str(cause)
    if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return path, "unknown field" + _unknown_hint(path)
    if e["type"] == "value_error":
        return path, str(cause) if cause is not None else e["msg"]
    kind = e["type"].split("_")[0]
    if kind in _TYPE_MESSAGES and e["type"].endswith(("_type", "_parsing", "_from_float")):
        return path, f"{_TYPE_MESSAGES[kind]}, got {_describe(e['input'])}"
    return path, e["msg"]


def _first_problem(err: ValidationError) -> tuple[str, str]:
    return _problem(err.errors()[0])


def field_names(cls: Any) -> list[str]:
    """The keys a config section accepts, read from its class (pydantic model, pydantic or plain dataclass), so a
    field added to a section is known here without a list to keep in step."""
    if hasattr(cls, "__pydantic_fields__"):
        return list(cls.__pydantic_fields__)
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return []


def _section_class(parts: list[str]) -> Any:
    """The class that validates the mapping at `parts` (`[]`: the whole file, `["target", "pretrain"]`, ...)."""
    cls: Any = RunConfig
    for name in parts:
        if hasattr(cls, "__pydantic_fields__"):
            field = cls.__pydantic_fields__.get(name)
            annotation = field.annotation if field is not None else None
        else:
            annotation = typing.get_type_hints(cls).get(name) if dataclasses.is_dataclass(cls) else None
        sections = [k for k in _kinds(annotation) if isinstance(k, type) and field_names(k)]
        if not sections:
            return None
        cls = sections[0]
    return cls


def _unknown_hint(path: str) -> str:
    """` (did you mean 'max_steps'?)` for a near miss, else the section's known keys."""
    parts = path.split(".")
    section = _section_class(parts[:-1])
    names = sorted(field_names(section)) if section is not None else []
    close = difflib.get_close_matches(parts[-1], names, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f" (known: {', '.join(names)})" if names else ""


def config_from_dict(data: Any, source: str = "<dict>",
                     lines: dict[tuple[str, ...], int] | None = None, quick: bool = False) -> RunConfig:
    """Build and check a RunConfig; errors name `source`, the field's line (when `lines` is given) and the field.

    Every field problem is reported, one line each in file order (`ConfigError.problems`), not just the first:
    a user fixes them in one pass. Rules between two fields are checked once the fields themselves are valid.
    `quick`: leave out the one check that imports torch (target.arch's key names, read from transformers), for the
    CLI's check before it imports torch; the full load that follows makes it.
    """
    lines = dict(lines or {})
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _error(source, lines, "", f"expected a mapping of sections, got {_describe(data)}")
    try:
        cfg = RunConfig.model_validate(data, context={"quick": quick})
    except ValidationError as err:
        found: dict[str, tuple[int, int]] = {}  # each problem once, in file order
        for i, (path, msg) in enumerate(_problem(e) for e in err.errors()):
            line = _line(lines, path)
            found.setdefault(yamlfile.format_problem(source, line, path, msg), (line or 0, i))
        problems = sorted(found, key=found.__getitem__)
        raise ConfigError("\n".join(problems), problems) from None
    except FieldProblem as exc:  # pragma: no cover - pydantic wraps ValueErrors; kept for direct raises
        raise _error(source, lines, exc.path, str(exc)) from None
    cfg._source = source
    cfg._lines = lines
    return cfg


def load_config(path: str | Path, quick: bool = False) -> RunConfig:
    """Load a YAML run config. Relative data/tokenizer paths are resolved against the config file's directory.
    `quick`: without the check that imports torch (config_from_dict), for the CLI's check before torch."""
    p = Path(path)
    try:
        raw = yamlfile.read_bytes(p, str(path))  # refused past yamlfile.MAX_CONFIG_BYTES
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    except yamlfile.YamlFileError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    try:
        doc = yamlfile.parse(yamlfile.decode(raw, str(path)), str(path))
    except yamlfile.YamlFileError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    if doc.data is None or doc.data == {}:
        # every field has a default, so an empty file would silently train the defaults
        raise ConfigError(f"{path}: {EMPTY_HINT}")
    cfg = config_from_dict(doc.data, str(path), doc.lines, quick=quick)
    base = p.resolve().parent
    cfg.data.paths = [str(_resolve(base, x)) for x in cfg.data.paths]
    if cfg.data.tokenizer is not None:
        cfg.data.tokenizer = str(_resolve(base, cfg.data.tokenizer))
    if cfg.target.path is not None:
        cfg.target.path = str(_resolve(base, cfg.target.path))
    if cfg.train.init_from is not None:
        cfg.train.init_from = str(_resolve(base, cfg.train.init_from))
    return cfg  # target.path is checked by check_run: a shipped config names a path on the training box


def check_mask_token_id(cfg: RunConfig, rows: int, what: str) -> None:
    """The drafter's mask token is a row of the target's embedding: the one rule for drafter.mask_token_id.

    Not the tokenizer's length: real targets reserve the mask id past the tokenizer's last token (Qwen3 drafters use
    151669), so what bounds it is the embedding's row count, `what` names where that number came from.
    """
    m = cfg.drafter.mask_token_id
    if m is not None and m >= rows:
        raise cfg.error(f"drafter.mask_token_id: must be < the target's embedding rows ({rows}, {what}), got {m}")


def check_run(cfg: RunConfig, device_type: str, vocab: int | None = None) -> None:
    """Every check of a run, done once before it touches its directory: the fields again (a RunConfig changed in
    code has not been through validation), then what needs the target's shape or the device.

    These would otherwise fail only when the target or drafter is built, after `--fresh` has deleted checkpoints and
    events.jsonl has been truncated. `vocab` is the tokenizer's size when already known. Raises ConfigError.
    """
    from dflash.target import check_vocab_rows, resolve_tap_layers, target_shape

    key = repr((cfg.to_dict(), device_type, vocab))
    if cfg._checked == key:
        return  # the CLI checked it before its own steps (target.pretrain); train() would check it again
    config_from_dict(cfg.to_dict(), cfg.source or "<config>", cfg.lines)
    try:
        shape = target_shape(cfg.target, vocab)
        resolve_tap_layers(cfg.target.tap_layers, shape.num_layers, cfg.drafter.num_layers)
    except ValueError as exc:  # target.py names the field (target.path, target.tap_layers, target.arch...)
        raise cfg.error(exc) from None
    r = cfg.drafter
    if r.hidden_size is not None and r.hidden_size != shape.hidden_size:
        raise cfg.error(f"drafter.hidden_size: must equal the target hidden size {shape.hidden_size} (the drafter "
                        f"reads the target's embedding and LM head), got {r.hidden_size}")
    if cfg.data.tokenizer is None:  # the tiny BPE may use up to data.vocab_size ids: the embedding needs the rows
        try:
            check_vocab_rows(cfg.target, cfg.data.vocab_size, "the tiny tokenizer's data.vocab_size")
        except ValueError as exc:
            raise cfg.error(exc) from None
    if shape.vocab_size is not None:
        check_mask_token_id(cfg, shape.vocab_size, shape.vocab_from)
    elif cfg.data.tokenizer is None:  # the tiny BPE: the embedding gets its vocabulary, at most data.vocab_size
        check_mask_token_id(cfg, cfg.data.vocab_size, "the tiny tokenizer's data.vocab_size")
    if device_type != "cuda" and r.attention in ("flex", "flex-eager"):
        raise cfg.error(f"drafter.attention: {r.attention} needs a CUDA device (flex-attention has no CPU "
                        "backward); use auto or dense on CPU")
    cfg._checked = key


def _resolve(base: Path, value: str) -> Path:
    """Relative paths mean 'next to the config file' when that exists there, else relative to the working dir."""
    q = Path(value).expanduser()
    if q.is_absolute() or not (base / q).exists():
        return q
    return base / q
