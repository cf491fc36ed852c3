"""The frozen target's normalisation and activation math run as fused kernels in the packed training forward
(issue 24: the target forward past plain transformers).

Eager transformers runs each Qwen3.5 RMSNorm as separate fp32 passes over [tokens, width] (cast, square, mean, rsqrt,
two products, cast back), the gated norm of every Gated DeltaNet layer the same plus a SiLU, and the MLP's
silu(gate) * up as two more. Here the same expressions, written out once, are compiled by torch.compile into one
kernel each (graphs shared by every layer: a weight is an argument, not a guard on a module; a row length that
varies from step to step is compiled once as a symbolic size).
Only the packed training forward uses them (`Target` turns them on around its own call): cached decoding, the
padded path and the regen/eval loops keep transformers' eager modules, so their shapes never reach the compiler.
Each kind is checked once against the eager module on its first real input; a kind whose result differs by more
than the dtype's rounding (another transformers version with other math) goes back to eager with a log line.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The transformers classes whose forward these functions restate (transformers/models/qwen3_5/modeling_qwen3_5.py).
NORM, GATED_NORM, MLP = "Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP"
# Largest |fused - eager| / max|eager| accepted at the first-call check: a few units of the output dtype's rounding
# (the compiled reduction sums in another order), far below any change of formula.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3_5RMSNorm.forward: zero-centred weight, applied in fp32 before the cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def rms_norm_gated(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3_5RMSNormGated.forward (activation silu): normalise, weight in the input dtype, gate in fp32."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """Qwen3_5MLP's act_fn(gate_proj(x)) * up_proj(x) for act silu."""
    return F.silu(gate) * up


@dataclass
class Fusion:
    """The compiled functions and which module kinds use them; `active` is on only inside `Fusion.on()`."""

    backend: str = "inductor"
    active: bool = False
    patched: dict[str, int] = field(default_factory=dict)  # kind -> modules
    checked: dict[str, float] = field(default_factory=dict)  # kind -> relative error at its first-call check
    refused: dict[str, str] = field(default_factory=dict)  # kind -> why it went back to eager
    log: Callable[[str], None] = print
    fns: dict[str, Callable[..., Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # dynamic=None (dynamo's automatic dynamic): a fixed-shape row (the CUDA graph's, the bench's) compiles one
        # static graph; a run whose packed rows vary in length recompiles once with the token count symbolic, then
        # every length reuses it (static shapes would recompile per length until dynamo's limit sent it to eager).
        # inductor computes a bf16 expression in fp32 and rounds once at the store; eager rounds every bf16
        # intermediate (the gated norm's weight product, silu(gate) before the multiply). Emulating those roundings
        # keeps the fused states on eager's (measured on an H100 at 4B-like without it: 2.1x eager's error against the
        # padded forward), which is what the in-training tau against the eager decode loop needs.
        options = {"emulate_precision_casts": True} if self.backend == "inductor" else None

        def compiled(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
            return torch.compile(fn, backend=self.backend, fullgraph=True, dynamic=None, options=options)

        self.fns = {NORM: compiled(rms_norm), GATED_NORM: compiled(rms_norm_gated), MLP: compiled(silu_mul)}

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        before, self.active = self.active, True
        try:
            yield
        finally:
            self.active = before

    def use(self, kind: str) -> bool:
        return self.active and kind not in self.refused

    def call(self, kind: str, *args: Any) -> Tensor | None:
        """The fused function of a kind, or None (the caller runs eager) once it has failed: a compile error (another
        torch, a backend missing on this machine) costs one log line and that kind's speed, never the step."""
        try:
            return self.fns[kind](*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: eager is always right
            self.refused[kind] = f"the compiled function failed: {type(exc).__name__}: {str(exc)[:300]}"
            self.log(f"target.fused_elementwise: {kind} back to eager: {self.refused[kind]}")
            return None

    def check(self, kind: str, fused: Tensor, eager: Tensor) -> Tensor:
        """The first real call of a kind: keep the fused path only where it equals eager to the dtype's rounding."""
        scale = float(eager.detach().abs().max().float().clamp_min(1e-30))
        err = float((fused.detach().float() - eager.detach().float()).abs().max()) / scale
        tol = TOLERANCE.get(eager.dtype, 1e-5)
        self.checked[kind] = err
        if not err <= tol:
            self.refused[kind] = f"differs from transformers' {kind} by {err:.2e} (tolerance {tol:.0e})"
            self.log(f"target.fused_elementwise: {kind} back to eager: {self.refused[kind]}")
        return eager


def _norm_forward(fusion: Fusion) -> Callable[..., Tensor]:
    def forward(self: nn.Module, x: Tensor) -> Tensor:
        out = fusion.call(NORM, x, self.weight, float(self.eps)) if fusion.use(NORM) else None
        if out is None:
            return type(self).forward(self, x)
        return out if NORM in fusion.checked else fusion.check(NORM, out, type(self).forward(self, x))
    return forward


def _gated_forward(fusion: Fusion) -> Callable[..., Tensor]:
    def forward(self: nn.Module, hidden_states: Tensor, gate: Tensor) -> Tensor:
        out = (fusion.call(GATED_NORM, hidden_states, gate, self.weight, float(self.variance_epsilon))
               if fusion.use(GATED_NORM) else None)
        if out is None:
            return type(self).forward(self, hidden_states, gate)
        if GATED_NORM in fusion.checked:
            return out
        return fusion.check(GATED_NORM, out, type(self).forward(self, hidden_states, gate))
    return forward


def _mlp_forward(fusion: Fusion) -> Callable[..., Tensor]:
    def forward(self: nn.Module, x: Tensor) -> Tensor:
        act = fusion.call(MLP, self.gate_proj(x), self.up_proj(x)) if fusion.use(MLP) else None
        if act is None:
            return type(self).forward(self, x)
        out = self.down_proj(act)
        return out if MLP in fusion.checked else fusion.check(MLP, out, type(self).forward(self, x))
    return forward


def _fusable(module: nn.Module) -> str | None:
    """The kind of a module these functions restate exactly, by class and the attributes its forward reads."""
    name = type(module).__name__
    if name == NORM and isinstance(getattr(module, "eps", None), float):
        return NORM
    if (name == GATED_NORM and getattr(module, "activation", None) == "silu"
            and isinstance(getattr(module, "variance_epsilon", None), float)):
        return GATED_NORM
    if name == MLP and all(isinstance(getattr(module, p, None), nn.Linear) for p in ("gate_proj", "up_proj",
                                                                                     "down_proj")):
        act = getattr(module, "act_fn", None)
        if isinstance(act, nn.SiLU) or getattr(getattr(module, "config", None), "hidden_act", None) == "silu":
            return MLP
    return None


def fuse(model: nn.Module, backend: str = "inductor", log: Callable[[str], None] = print) -> Fusion:
    """Give the model's Qwen3.5 norms and MLPs forwards that take the fused path while `fusion.on()` is active (the
    instance attribute shadows the class's forward; outside it they call the class's own forward unchanged)."""
    fusion = Fusion(backend=backend, log=log)
    makers = {NORM: _norm_forward, GATED_NORM: _gated_forward, MLP: _mlp_forward}
    forwards = {kind: make(fusion) for kind, make in makers.items()}
    for module in model.modules():
        kind = _fusable(module)
        if kind is not None:
            module.forward = types.MethodType(forwards[kind], module)
            fusion.patched[kind] = fusion.patched.get(kind, 0) + 1
    return fusion


def unfuse(model: nn.Module) -> int:
    """Give every patched module its class's forward back (benches compare both on one model)."""
    n = 0
    for module in model.modules():
        if _fusable(module) is not None and "forward" in module.__dict__:
            del module.__dict__["forward"]
            n += 1
    return n


def describe(fusion: Fusion | None) -> str:
    if fusion is None:
        return "target.fused_elementwise: off"
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(fusion.patched.items())) or "no Qwen3.5 norm or MLP found"
    return f"target.fused_elementwise: compiled ({fusion.backend}) for {kinds}"


__all__ = ["GATED_NORM", "MLP", "NORM", "Fusion", "describe", "fuse", "rms_norm", "rms_norm_gated", "silu_mul",
           "unfuse"]
