"""The run configuration of `dflash train`: dataclasses loaded from YAML with strict checking.

A typo or a wrong type fails at once with `ConfigError` naming the file and the field path, before anything is written.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash import yamlfile
from dflash.model import DrafterConfig
from dflash.target import TargetConfig


class ConfigError(ValueError):
    """A config problem, already phrased as the one line the CLI prints (`FILE:LINE: a.b: what is wrong`)."""


EMPTY_HINT = "empty config (see configs/tiny.yaml for a complete one)"


@dataclass
class DataConfig:
    # Files or directories of `.txt` / `.jsonl`; empty = the embedded default corpus (Python's own stdlib sources).
    paths: list[str] = field(default_factory=list)
    format: str = "auto"  # auto | text | chat
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


@dataclass
class TrainConfig:
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.1  # cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    epochs: int = 1
    max_steps: int | None = None  # when set, the run length (more epochs are scheduled if one is not enough)
    seed: int = 0
    checkpoint_every: int = 100  # steps; 0 = only at the end / on a signal
    keep_last: int = 3
    heartbeat_s: float = 5.0
    log_every: int = 1
    compile: str = "auto"  # auto (GPU only) | true | false
    compile_backend: str = "inductor"  # torch.compile backend ("eager"/"aot_eager" check tracing without codegen)


@dataclass
class DistConfig:
    # colocated: every rank runs target + drafter. split: the last `target_ranks` ranks run the target,
    # the first ones train the drafter (DDP among them), so rank 0 always has the loss.
    roles: str = "colocated"
    target_ranks: int = 1
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | gloo | nccl


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    source: str | None = None  # the file it was loaded from (not a YAML key)
    # key path -> 1-based line in `source` (not a YAML key), so errors found after loading still name the line
    lines: dict[tuple[str, ...], int] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source", None)
        out.pop("lines", None)
        return out

    def error(self, exc_or_msg: Exception | str) -> ConfigError:
        """`FIELD: message` -> a ConfigError `FILE:LINE: FIELD: message`, the line looked up in the loaded file."""
        return ConfigError(_located(str(exc_or_msg), self.source or "<config>", self.lines))


def _located(msg: str, source: str, lines: dict[tuple[str, ...], int]) -> str:
    """Prefix `field.path: what` with the file and the field's line (or its nearest ancestor's)."""
    head = msg.split(": ", 1)[0] if ": " in msg else ""
    loc = tuple(p for p in head.replace("[", ".").replace("]", "").split(".") if p) if head and " " not in head else ()
    line = yamlfile.line_for(lines, loc) if loc and lines else None
    return f"{source}:{line}: {msg}" if line is not None else f"{source}: {msg}"


_CHOICES: dict[str, tuple[str, ...]] = {
    "data.format": ("auto", "text", "chat"),
    "train.compile": ("auto", "true", "false"),
    "dist.roles": ("colocated", "split"),
    "dist.backend": ("auto", "gloo", "nccl"),
    "drafter.attention": ("auto", "flex", "dense", "flex-eager"),
    "target.dtype": ("auto", "float32", "bfloat16", "float16"),
    "target.packing": ("auto", "pad", "varlen"),
}


def _describe(value: Any) -> str:
    return repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check one YAML value against a type hint; return it converted (int -> float where a float is wanted)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: got {_describe(value)}, expected {tp}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {_describe(value)}")
        (inner,) = typing.get_args(tp) or (Any,)
        return [_convert(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_describe(value)}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)  # `max_chars: 1e6`: YAML reads it as a float; its value is an integer
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if isinstance(value, bool) and where in _CHOICES and str(value).lower() in _CHOICES[where]:
            return str(value).lower()  # YAML reads `compile: true` as a bool
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_describe(value)}")
        return value
    raise ConfigError(f"{where}: unsupported field type {tp}")


def _build(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a mapping, refusing unknown keys (a typo must not be silently ignored)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init and f.name != "source"}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise ConfigError(f"{path}: unknown field (known: {', '.join(sorted(names))})")
        converted = _convert(value, hints[key], path)
        if path in _CHOICES and converted not in _CHOICES[path]:
            raise ConfigError(f"{path}: expected one of {', '.join(_CHOICES[path])}, got {_describe(value)}")
        kwargs[key] = converted
    return cls(**kwargs)


def _check_ranges(cfg: RunConfig) -> None:
    def need(ok: bool, path: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{path}: {msg}")

    d, t = cfg.data, cfg.train
    need(d.max_len >= 2, "data.max_len", f"must be at least 2, got {d.max_len}")
    need(d.token_budget >= d.max_len, "data.token_budget",
         f"must be at least data.max_len ({d.max_len}), got {d.token_budget}")
    need(d.reservoir >= 1, "data.reservoir", f"must be at least 1, got {d.reservoir}")
    need(d.num_buckets >= 1, "data.num_buckets", f"must be at least 1, got {d.num_buckets}")
    need(t.lr > 0, "train.lr", f"must be positive, got {t.lr}")
    need(0 <= t.warmup_frac < 1, "train.warmup_frac", f"must be in [0, 1), got {t.warmup_frac}")
    need(t.epochs >= 1, "train.epochs", f"must be at least 1, got {t.epochs}")
    need(t.max_steps is None or t.max_steps >= 1, "train.max_steps", f"must be at least 1, got {t.max_steps}")
    need(t.keep_last >= 1, "train.keep_last", f"must be at least 1, got {t.keep_last}")
    need(t.checkpoint_every >= 0, "train.checkpoint_every", f"must be >= 0, got {t.checkpoint_every}")
    need(len(t.betas) == 2, "train.betas", f"must be two numbers, got {t.betas}")
    need(t.heartbeat_s > 0, "train.heartbeat_s", f"must be positive, got {t.heartbeat_s}")
    need(t.log_every >= 1, "train.log_every", f"must be at least 1, got {t.log_every}")
    need(cfg.dist.target_ranks >= 1, "dist.target_ranks", f"must be at least 1, got {cfg.dist.target_ranks}")
    need(1 <= d.min_len <= d.max_len, "data.min_len", f"must be in 1..data.max_len ({d.max_len}), got {d.min_len}")

    r = cfg.drafter
    need(r.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {r.num_layers}")
    need(r.num_heads >= 1, "drafter.num_heads", f"must be >= 1, got {r.num_heads}")
    need(r.num_kv_heads >= 1, "drafter.num_kv_heads", f"must be >= 1, got {r.num_kv_heads}")
    need(r.num_heads % r.num_kv_heads == 0, "drafter.num_heads",
         f"must be a multiple of drafter.num_kv_heads ({r.num_kv_heads}), got {r.num_heads}")
    need(r.block_size >= 2, "drafter.block_size", f"must be >= 2, got {r.block_size}")
    # Anchors are drawn without replacement from the token_budget positions of one fixed-shape buffer.
    need(1 <= r.num_anchors <= d.token_budget, "drafter.num_anchors",
         f"must be in 1..data.token_budget ({d.token_budget}), got {r.num_anchors}")
    need(r.loss_gamma > 0, "drafter.loss_gamma", f"must be > 0, got {r.loss_gamma}")
    need(r.ce_chunk >= 1, "drafter.ce_chunk", f"must be >= 1, got {r.ce_chunk}")
    for key in ("hidden_size", "head_dim", "intermediate_size", "sliding_window"):
        v = getattr(r, key)
        need(v is None or v >= 1, f"drafter.{key}", f"must be >= 1, got {v}")
    if r.layer_sliding_windows is not None:
        need(len(r.layer_sliding_windows) == r.num_layers, "drafter.layer_sliding_windows",
             f"needs drafter.num_layers ({r.num_layers}) entries, got {len(r.layer_sliding_windows)}")
    if r.mask_token_id is not None:
        need(r.mask_token_id >= 0, "drafter.mask_token_id", f"must be >= 0, got {r.mask_token_id}")
        if d.tokenizer is None:  # the tiny BPE: its vocabulary is data.vocab_size at most
            need(r.mask_token_id < d.vocab_size, "drafter.mask_token_id",
                 f"must be < data.vocab_size ({d.vocab_size}), got {r.mask_token_id}")
    _check_arch(cfg)


def _check_arch(cfg: RunConfig) -> None:
    """target.arch keys are Qwen3_5TextConfig kwargs; that class accepts any kwarg, so a typo would pass silently."""
    arch = cfg.target.arch
    if not arch:
        return
    import inspect

    from transformers import Qwen3_5TextConfig

    known = set(Qwen3_5TextConfig().to_dict()) | set(inspect.signature(Qwen3_5TextConfig.__init__).parameters)
    known -= {"self", "kwargs", "_name_or_path", "transformers_version", "model_type"}
    for key in arch:
        if key not in known:
            raise ConfigError(f"target.arch.{key}: unknown Qwen3_5TextConfig field (known: {', '.join(sorted(known))})")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size"):
        if key in arch:
            v = arch[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"target.arch.{key}: must be an integer >= 1, got {_describe(v)}")


def config_from_dict(data: Any, source: str = "<dict>",
                     lines: dict[tuple[str, ...], int] | None = None) -> RunConfig:
    """Build and check a RunConfig; errors are prefixed with `source` and, when `lines` is given, the field's line."""
    try:
        cfg = _build(RunConfig, data, "")
        _check_ranges(cfg)
    except ConfigError as exc:
        raise ConfigError(_located(str(exc), source, lines or {})) from None
    cfg.source = source
    cfg.lines = dict(lines or {})
    return cfg


def load_config(path: str | Path) -> RunConfig:
    """Load a YAML run config. Relative data/tokenizer paths are resolved against the config file's directory."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    try:
        doc = yamlfile.parse(yamlfile.decode(raw, str(path)), str(path))
    except yamlfile.YamlFileError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    if doc.data is None or doc.data == {}:
        # every field has a default, so an empty file would silently train the defaults
        raise ConfigError(f"{path}: {EMPTY_HINT}")
    cfg = config_from_dict(doc.data, str(path), doc.lines)
    base = p.resolve().parent
    cfg.data.paths = [str(_resolve(base, x)) for x in cfg.data.paths]
    if cfg.data.tokenizer is not None:
        cfg.data.tokenizer = str(_resolve(base, cfg.data.tokenizer))
    if cfg.target.path is not None:
        cfg.target.path = str(_resolve(base, cfg.target.path))
    return cfg  # target.path is checked by check_run: a shipped config names a path on the training box


def _check_target_path(cfg: RunConfig) -> None:
    p = cfg.target.path
    if p is not None and not Path(p).is_dir():
        what = "does not exist" if not Path(p).exists() else "is not a directory"
        raise ConfigError(f"target.path: {p} {what} (a local Hugging Face model directory)")


def _target_shape(cfg: RunConfig) -> tuple[int, int]:
    """(num_layers, hidden_size) of the target from its config alone: no weights, no model built."""
    if cfg.target.path is not None:
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(cfg.target.path, local_files_only=True)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"target.path: {cfg.target.path}: cannot read its config.json ({first})") from None
        text = hf.get_text_config()
        return int(text.num_hidden_layers), int(text.hidden_size)
    from dflash.target import TINY_ARCH

    arch = {**TINY_ARCH, **cfg.target.arch}
    if "layer_types" in cfg.target.arch and len(arch["layer_types"]) != arch["num_hidden_layers"]:
        raise ConfigError(f"target.arch.layer_types: has {len(arch['layer_types'])} entries for "
                          f"target.arch.num_hidden_layers={arch['num_hidden_layers']}")
    return int(arch["num_hidden_layers"]), int(arch["hidden_size"])


def check_run(cfg: RunConfig, device_type: str) -> None:
    """The checks that need the target's shape or the device, done before a run touches its directory.

    They would otherwise fail only when the target or drafter is built, after `--fresh` has deleted checkpoints and
    events.jsonl has been truncated. Raises ConfigError (`FILE: field: what`).
    """
    from dflash.target import default_tap_layers

    try:
        _check_ranges(cfg)  # again: a RunConfig built or changed in code has not been through config_from_dict
        _check_target_path(cfg)
        n_layers, hidden = _target_shape(cfg)
        r = cfg.drafter
        if cfg.target.tap_layers is not None:
            if not cfg.target.tap_layers:
                raise ConfigError("target.tap_layers: must name at least one layer")
            for t in cfg.target.tap_layers:
                if not 0 <= t < n_layers:
                    raise ConfigError(f"target.tap_layers: layer {t} is outside 0..{n_layers - 1}")
        else:
            try:
                default_tap_layers(n_layers, r.num_layers)
            except ValueError as exc:
                raise ConfigError(f"target.tap_layers: {exc}; set target.tap_layers") from None
        if r.hidden_size is not None and r.hidden_size != hidden:
            raise ConfigError(f"drafter.hidden_size: must equal the target hidden size {hidden} (the drafter "
                              f"reads the target's embedding and LM head), got {r.hidden_size}")
        if device_type != "cuda" and r.attention in ("flex", "flex-eager"):
            raise ConfigError(f"drafter.attention: {r.attention} needs a CUDA device (flex-attention has no CPU "
                              "backward); use auto or dense on CPU")
    except ConfigError as exc:
        raise cfg.error(exc) from None


def _resolve(base: Path, value: str) -> Path:
    """Relative paths mean 'next to the config file' when that exists there, else relative to the working dir."""
    q = Path(value).expanduser()
    if q.is_absolute() or not (base / q).exists():
        return q
    return base / q
