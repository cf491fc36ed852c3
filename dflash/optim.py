"""The drafter's optimizer and schedule: AdamW (the default), or Muon on the 2-D weight matrices with AdamW on the
rest (speculators' default for DFlash; issue 40's ablation), each with the warm-up + cosine multiplier.

Why one object each: the trainer and its checkpoints keep calling `opt.step()`, `opt.state_dict()`,
`sched.get_last_lr()`; with AdamW alone the state dicts are exactly AdamW's and LambdaLR's, so checkpoints written
before this module resume unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")


def split_for_muon(named: Sequence[tuple[str, nn.Parameter]]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon, AdamW): Muon takes the trainable 2-D matrices with both sides > 1 (all it orthogonalises); norms,
    biases and degenerate [1, N] weights go to AdamW. The drafter owns no embedding or LM head (the target's)."""
    muon, adamw = [], []
    for _, p in named:
        if not p.requires_grad:
            continue
        (muon if p.ndim == 2 and min(p.shape) > 1 else adamw).append(p)
    return muon, adamw


class OptimizerSet:
    """Several optimizers stepped together, seen as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def state_dict(self) -> dict[str, Any]:
        if len(self.optimizers) == 1:
            return self.optimizers[0].state_dict()
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = state["optimizers"] if "optimizers" in state else [state]
        if len(parts) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(parts)} optimizer state(s), this run builds "
                             f"{len(self.optimizers)} (train.optimizer changed?)")
        for o, s in zip(self.optimizers, parts, strict=True):
            o.load_state_dict(s)


class SchedulerSet:
    """One LambdaLR per optimizer, the same multiplier: `get_last_lr()[0]` is the base lr times it."""

    def __init__(self, optimizers: OptimizerSet, multiplier: Callable[[int], float]) -> None:
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, multiplier) for o in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        if len(self.schedulers) == 1:
            return self.schedulers[0].state_dict()
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = state["schedulers"] if "schedulers" in state else [state]
        for s, p in zip(self.schedulers, parts, strict=True):
            s.load_state_dict(p)


def build_optimizer(named: Sequence[tuple[str, nn.Parameter]], kind: str, lr: float, betas: Sequence[float],
                    weight_decay: float, muon_weight_decay: float, multiplier: Callable[[int], float]
                    ) -> tuple[OptimizerSet, SchedulerSet]:
    params = [p for _, p in named if p.requires_grad]
    if kind == "adamw":
        opts: list[torch.optim.Optimizer] = [torch.optim.AdamW(params, lr=lr, betas=(betas[0], betas[1]),
                                                               weight_decay=weight_decay)]
    elif kind == "muon":
        muon, rest = split_for_muon(named)
        # match_rms_adamw scales Muon's update to AdamW's RMS, so one lr serves both groups (speculators' default)
        opts = [torch.optim.Muon(muon, lr=lr, weight_decay=muon_weight_decay, adjust_lr_fn="match_rms_adamw")]
        if rest:
            opts.append(torch.optim.AdamW(rest, lr=lr, betas=(betas[0], betas[1]), weight_decay=weight_decay))
    else:
        raise ValueError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
    opt = OptimizerSet(opts)
    return opt, SchedulerSet(opt, multiplier)
