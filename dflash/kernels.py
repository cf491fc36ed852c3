"""Preflight kernel inspection: which implementation the loaded target really calls, and whether flex runs compiled.

A run on the slow PyTorch fallback (or uncompiled flex-attention) is correct but many times slower; it must be loud.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os
import platform
import re
import sys
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn

# The four linear-attention ops that decide whether a hybrid target runs fast.
LINEAR_ATTENTION_OPS = (
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
# The module-level names transformers has used for each op (5.2x wraps `torch_*`; older qwen3_next-style code binds
# the fla function, or None, under the op's own name).
_MODULE_NAMES = {
    "chunk_gated_delta_rule": ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"),
    "fused_recurrent_gated_delta_rule": ("torch_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "causal_conv1d_fn": ("causal_conv1d_fn",),
    "causal_conv1d_update": ("causal_conv1d_update",),
}
FAST = {
    "chunk_gated_delta_rule": "fla",
    "fused_recurrent_gated_delta_rule": "fla",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
}
SLOW = "torch-fallback"
ABSENT = "absent"


def _classify(fn: Any) -> str:
    """Name the package a callable comes from: fla, causal_conv1d, torch-fallback (transformers' own code), or hub:…"""
    if fn is None:
        return SLOW  # old-style modules bind None and take the in-forward PyTorch path
    target = inspect.unwrap(fn) if not _is_fallback_wrapper(fn) else _wrapper_implementation(fn)
    module = getattr(target, "__module__", None) or ""
    top = module.split(".")[0]
    if top in ("fla", "causal_conv1d"):
        return top
    if top == "transformers":
        return SLOW
    if top:
        return f"other:{module}"  # e.g. a kernels-hub build: fast or not, preflight names it instead of guessing
    return "unknown"


def _cells(fn: Any) -> dict[str, Any]:
    closure = getattr(fn, "__closure__", None)
    code = getattr(fn, "__code__", None)
    if not closure or code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure, strict=True)}


def _fallback_wrapper(fn: Any) -> Any:
    """transformers' `use_kernel_func_from_hub_with_fallback` wrapper (a function whose closure holds
    `implementation` and `torch_function`) behind `fn`, or None. 5.2x binds that function itself; from 5.25 the
    module global is a `Func` nn.Module whose `forward` closes over it as `func`."""
    cells = _cells(fn)
    if "implementation" in cells and "torch_function" in cells:
        return fn
    if isinstance(fn, nn.Module):
        inner = _cells(getattr(fn, "forward", None)).get("func")
        if inner is not None and inner is not fn:
            return _fallback_wrapper(inner)
    return None


def _is_fallback_wrapper(fn: Any) -> bool:
    """True when `fn` hides transformers' choice of kernel (fla, or its own PyTorch code) in a fallback wrapper."""
    return _fallback_wrapper(fn) is not None


def _wrapper_implementation(fn: Any) -> Any:
    return _cells(_fallback_wrapper(fn))["implementation"]


def _linear_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet (or similar) mixers of a hybrid model, found by their `linear_attn` attribute name."""
    found = []
    for module in model.modules():
        mixer = getattr(module, "linear_attn", None)
        if isinstance(mixer, nn.Module):
            found.append(mixer)
    return found


def _bound_op(mixer: nn.Module, op: str) -> tuple[bool, Any]:
    """The callable a mixer uses for `op`: an instance attribute if the module binds one, else its module's global."""
    if op in mixer.__dict__ or hasattr(type(mixer), op):
        return True, getattr(mixer, op)
    mod = sys.modules.get(type(mixer).__module__)
    for name in _MODULE_NAMES[op]:
        if mod is not None and hasattr(mod, name):
            return True, getattr(mod, name)
    return False, None


def inspect_kernels(model: nn.Module) -> dict[str, str]:
    """For a loaded target, which implementation each linear-attention op is bound to (after loading, as called).

    Values: "fla", "causal_conv1d", "torch-fallback", "other:<module>", or "absent" when the model has no
    linear-attention layers (a pure-attention target needs none of these kernels).
    """
    mixers = _linear_attention_modules(model)
    if not mixers:
        return dict.fromkeys(LINEAR_ATTENTION_OPS, ABSENT)
    result: dict[str, str] = {}
    for op in LINEAR_ATTENTION_OPS:
        kinds = set()
        for mixer in mixers:
            ok, fn = _bound_op(mixer, op)
            kinds.add(_classify(fn) if ok else "unknown")
        # Layers disagreeing (some fast, some not) is reported as the slow one: one slow layer makes the model slow.
        result[op] = SLOW if SLOW in kinds else sorted(kinds)[0]
    return result


# transformers (5.2x, transformers/integrations/hub_kernels.py) says once per op and process that it "is falling back
# to its reference PyTorch implementation ... This is correct but much slower." On a CPU target that reference is
# the only implementation there is (fla and causal-conv1d are CUDA kernels), and the `target:` log line already names
# the kernels bound, so a newcomer's tiny CPU run should not read "much slower" twice. On a GPU the slow path is
# refused by check_kernels (or allowed loudly with allow_slow_kernels), whatever transformers logs.
HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"
FALLBACK_NOTICE = "is falling back to its reference PyTorch implementation"


class _ExpectedFallbackNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return FALLBACK_NOTICE not in record.getMessage()


def quiet_expected_fallback_notice(device: torch.device | str) -> None:
    """Drop transformers' fallback notice in this process once a target is built on the CPU (idempotent)."""
    if torch.device(device).type != "cpu":
        return
    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    if not any(isinstance(f, _ExpectedFallbackNotice) for f in logger.filters):
        logger.addFilter(_ExpectedFallbackNotice())


def varlen_usable(kernels: dict[str, str]) -> bool:
    """Packing with cu_seqlens keeps documents apart only if both the delta rule (fla) and the conv (seq_idx) are fast."""
    return kernels.get("chunk_gated_delta_rule") == "fla" and kernels.get("causal_conv1d_fn") == "causal_conv1d"


def package_version(dist: str) -> str | None:
    """An installed distribution's version; None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """The versions `run_start` reports: a missing kernel package is None, not an error."""
    import transformers

    dflash_version = package_version("dflash-ops")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "dflash": dflash_version,
        "fla": package_version("flash-linear-attention") or package_version("fla-core"),
        "causal_conv1d": package_version("causal-conv1d") or package_version("causal_conv1d"),
        "triton": package_version("triton"),
    }


def check_kernels(kernels: dict[str, str], device: torch.device | str, allow_slow: bool) -> list[str]:
    """The problems preflight refuses a run for: a slow fallback on a GPU (unless allowed). Empty list = go.

    On CPU the fallback is the only implementation there is, so it is never a problem there.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or allow_slow:
        return []
    problems = []
    for op, impl in kernels.items():
        if op not in FAST:
            continue
        if impl in (ABSENT, FAST[op]):
            continue
        want = "flash-linear-attention" if FAST[op] == "fla" else "causal-conv1d"
        problems.append(f"{op} runs {impl} on {dev} (install {want}, or pass --allow-slow-kernels)")
    attn = kernels.get("attention")
    if attn is not None and attn != "flex-compiled" and attn != "dense":
        problems.append(
            f"drafter attention runs {attn} on {dev}: flex-attention uncompiled materialises the full score matrix"
        )
    return problems


# --------------------------------------------------------------------------- flex-attention running uncompiled
_FLEX_UNCOMPILED = re.compile(r"flex_attention called without torch\.compile")
_FLEX_WARNING_ID = "flex_attention_performance"


_LIMIT_HIT = re.compile(r"recompile limit exceeded|hit config\.\w*(recompile|cache_size)_limit", re.IGNORECASE)
_DYNAMO_LOGGER = "torch._dynamo"


def recompile_limit_hits() -> int:
    """How many frames dynamo gave up on at a recompile limit so far in this process (its own counters).

    Each such frame runs uncompiled from then on: for flex_attention that is the unfused path with a dense score
    matrix. Dynamo counts the event as an "unimplemented" graph break whose message names the limit.
    """
    from torch._dynamo.utils import counters

    return sum(int(v) for k, v in counters["unimplemented"].items() if _LIMIT_HIT.search(str(k)))


class _LimitLog(logging.Handler):
    """Keeps dynamo's own "hit config.recompile_limit" warnings: they name the function and the last guard failure."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record must not break the training step
            return
        if _LIMIT_HIT.search(text):
            self.lines.append(" ".join(line.strip() for line in text.splitlines()[:3]))


class FlexWarningWatch:
    """Catch, inside a `with` block, the two ways compiled code silently becomes eager: flex-attention's "called
    without torch.compile()" warning, and dynamo giving up on a frame at its recompile limit.

    torch prints the flex warning only once per process and it is also the only sign that dynamo gave up (recompile
    limit) and fell back to eager flex with a dense score matrix; dynamo's counters and its warning log say the same
    for any compiled frame (the whole drafter step included). The train loop turns `triggered` into an
    `uncompiled_flex` error event and `fallbacks` into a `recompile` (or `uncompiled_flex`) one. Other warnings
    raised in the block are passed on unchanged. Not thread-safe (warnings state is process-global), like everything
    in `warnings`; the trainer has no GPU threads.
    """

    def __init__(self, on_trigger: Callable[[str], None] | None = None) -> None:
        self.triggered: list[str] = []
        self.fallbacks: list[str] = []
        self._on_trigger = on_trigger
        self._cm: warnings.catch_warnings | None = None
        self._log: list[warnings.WarningMessage] | None = None
        self._limit_log = _LimitLog()
        self._hits_before = 0

    def __enter__(self) -> FlexWarningWatch:
        _rearm_flex_warning()
        self._hits_before = recompile_limit_hits()
        logging.getLogger(_DYNAMO_LOGGER).addHandler(self._limit_log)
        self._cm = warnings.catch_warnings(record=True)
        self._log = self._cm.__enter__()
        warnings.filterwarnings("always", message=r"flex_attention called without torch\.compile")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._cm is not None and self._log is not None
        log = list(self._log)
        self._cm.__exit__(exc_type, exc, tb)
        logging.getLogger(_DYNAMO_LOGGER).removeHandler(self._limit_log)
        new_hits = recompile_limit_hits() - self._hits_before
        if new_hits > 0:
            named = self._limit_log.lines or [f"torch._dynamo hit its recompile limit ({new_hits} frame(s))"]
            self.fallbacks.extend(f"{line}: that code now runs uncompiled" for line in named)
        for w in log:
            text = str(w.message)
            if _FLEX_UNCOMPILED.search(text):
                line = text.strip().splitlines()[0]
                self.triggered.append(line)
                if self._on_trigger is not None:
                    self._on_trigger(line)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)

    @property
    def flex_fell_back(self) -> bool:
        """True when flex ran (or will run) uncompiled: its warning fired, or a fallback names flex_attention."""
        return bool(self.triggered) or any("flex_attention" in f or "create_block_mask" in f for f in self.fallbacks)


def _rearm_flex_warning() -> None:
    """torch remembers that it already warned (a module-level set); forget it so every watch can see it again."""
    try:
        fa = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return
    shown = getattr(fa, "_WARNINGS_SHOWN", None)
    if isinstance(shown, set):
        shown.discard(_FLEX_WARNING_ID)


def dynamo_counts() -> dict[str, int]:
    """Dynamo's process-wide compile counters; a growing `unique_graphs` after warm-up means recompiles."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "frames": int(counters["frames"].get("total", 0)),
    }


def _triton_version() -> tuple[int, ...] | None:
    text = package_version("triton")
    if text is None:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def fla_backward_refused(device: torch.device | str) -> bool:
    """fla 0.6 refuses the gated chunk backward on Hopper with Triton in [3.4.0, 3.7.1) (wrong results, fla #640).

    Forward passes are unaffected, so only code that trains through the target (pretraining) needs to route around it.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    tv = _triton_version()
    return torch.cuda.get_device_capability(dev)[0] == 9 and tv is not None and (3, 4, 0) <= tv < (3, 7, 1)


class reference_delta_rule:  # noqa: N801 - used as a context manager, named like one
    """Inside: the target's Gated DeltaNet chunk op is transformers' own PyTorch reference, outside: as loaded.

    Why: training *through* a hybrid target (dflash pretrain-target) on a card where fla refuses its backward
    (`fla_backward_refused`) must still run, correctly and slower, rather than crash. Only the module global that
    the mixers call is swapped, and restored on exit; the conv and recurrent ops keep their fast kernels.
    """

    def __init__(self, model: nn.Module) -> None:
        self._swapped: list[tuple[Any, str, Any]] = []
        for mixer in _linear_attention_modules(model):
            mod = sys.modules.get(type(mixer).__module__)
            name = _MODULE_NAMES["chunk_gated_delta_rule"][0]
            fn = getattr(mod, name, None) if mod is not None else None
            if fn is None or not _is_fallback_wrapper(fn) or any(s[0] is mod for s in self._swapped):
                continue
            self._swapped.append((mod, name, fn))
            self._reference = _cells(_fallback_wrapper(fn))["torch_function"]

    @property
    def active(self) -> bool:
        """True when there was a wrapped chunk op to swap (a hybrid target under transformers 5.2x)."""
        return bool(self._swapped)

    def __enter__(self) -> reference_delta_rule:
        for mod, name, _fn in self._swapped:
            setattr(mod, name, self._reference)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for mod, name, fn in self._swapped:
            setattr(mod, name, fn)


# ---------------------------------------------------------------------------------------------- float32 exactness
F32_ENV = "TRITON_F32_DEFAULT"
_FLA_TRIL = ("fla.ops.gated_delta_rule.chunk_fwd", "SOLVE_TRIL_DOT_PRECISION")


def exact_float32_kernels() -> dict[str, str | None]:
    """Make the Triton kernels of a float32 target compute in true float32 (IEEE dots) instead of TF32.

    Why: on cards with TF32 (Ampere, Hopper) fla's chunked Gated DeltaNet kernels multiply float32 blocks in TF32
    unless told otherwise: Triton's default dot precision (`TRITON_F32_DEFAULT`), and fla 0.6's own
    `SOLVE_TRIL_DOT_PRECISION`, which it sets to 'tf32' on such cards. A verify forward over a block (chunked) and a
    one-token decode step (recurrent, no dots) then differ by ~1e-3 relative, enough to flip a near-tie between two
    tokens, and a lossless check in float32 reports a failure where there is none (seen on an H200, 2026-12-03).
    Call before the process compiles its first fla kernel: Triton refuses to launch a kernel whose global changed
    after it compiled, so the module constant is left alone when fla's kernel already ran here (returned as is). An
    explicit `TRITON_F32_DEFAULT` set by the user wins. Returns what is in effect.
    """
    os.environ.setdefault(F32_ENV, "ieee")
    state: dict[str, str | None] = {"triton_f32_default": os.environ.get(F32_ENV), "fla_solve_tril": None}
    module_name, attr = _FLA_TRIL
    already = module_name in sys.modules
    try:
        mod = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - no fla, or no Triton (CPU set-ups): nothing to switch
        return state
    current = getattr(mod, attr, None)
    value = getattr(current, "value", current)
    if value is not None and value != "ieee" and (not already or _fla_kernels_compiled(mod) is False):
        import triton.language as tl

        setattr(mod, attr, tl.constexpr("ieee"))
        value = "ieee"
    state["fla_solve_tril"] = None if value is None else str(value)
    return state


def _fla_kernels_compiled(mod: Any) -> bool | None:
    """Whether a Triton kernel of `mod` has compiled in this process; None when that cannot be told (then the
    caller leaves the module alone: patching a compiled kernel's global makes its next launch raise)."""
    found = False
    for obj in vars(mod).values():
        fn = obj
        for _ in range(4):  # autotuner / heuristics wrappers around the JITFunction
            if hasattr(fn, "device_caches") or not hasattr(fn, "fn"):
                break
            fn = fn.fn
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            continue
        found = True
        for entry in caches.values():
            kernels = entry[0] if isinstance(entry, tuple) and entry else None
            if not isinstance(kernels, dict):
                return None
            if kernels:
                return True
    return False if found else None


def float32_is_exact(device: torch.device | str) -> bool:
    """Whether a float32 target on `device` computes in true float32 (CPU always; CUDA after exact_float32_kernels
    and with PyTorch's own TF32 off)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return True
    if torch.get_float32_matmul_precision() != "highest" or os.environ.get(F32_ENV) != "ieee":
        return False
    mod = sys.modules.get(_FLA_TRIL[0])
    value = getattr(getattr(mod, _FLA_TRIL[1], None), "value", getattr(mod, _FLA_TRIL[1], None)) if mod else None
    return value in (None, "ieee")
