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

import yaml

from dflash.model import DrafterConfig
from dflash.target import TargetConfig


class ConfigError(ValueError):
    """A config problem, already phrased as the one line the CLI prints (`FILE: a.b: what is wrong`)."""


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
    # colocated: every rank runs target + drafter. split: the first `target_ranks` ranks run the target,
    # the others train the drafter (DDP among them).
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

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source", None)
        return out


_CHOICES: dict[str, tuple[str, ...]] = {
    "data.format": ("auto", "text", "chat"),
    "train.compile": ("auto", "true", "false"),
    "dist.roles": ("colocated", "split"),
    "dist.backend": ("auto", "gloo", "nccl"),
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


def config_from_dict(data: Any, source: str = "<dict>") -> RunConfig:
    """Build and check a RunConfig; errors are prefixed with `source`."""
    try:
        cfg = _build(RunConfig, data, "")
        _check_ranges(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    cfg.source = source
    return cfg


def load_config(path: str | Path) -> RunConfig:
    """Load a YAML run config. Relative data/tokenizer paths are resolved against the config file's directory."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{line} invalid YAML: {getattr(exc, 'problem', exc)}") from None
    cfg = config_from_dict(data, str(path))
    base = p.resolve().parent
    cfg.data.paths = [str(_resolve(base, x)) for x in cfg.data.paths]
    if cfg.data.tokenizer is not None:
        cfg.data.tokenizer = str(_resolve(base, cfg.data.tokenizer))
    if cfg.target.path is not None:
        cfg.target.path = str(_resolve(base, cfg.target.path))
    return cfg


def _resolve(base: Path, value: str) -> Path:
    """Relative paths mean 'next to the config file' when that exists there, else relative to the working dir."""
    q = Path(value).expanduser()
    if q.is_absolute() or not (base / q).exists():
        return q
    return base / q
