"""dflash/train.py `Trainer._precapture_graphs` (target.cuda_graph): before the first step, one real buffer per
document-slot bucket the schedule needs goes through the target, so no step captures a graph mid-run.

A CUDA graph cannot exist on these CPU machines, so the target forward here is a stand-in for `compute_batch` that
does what the graph path does with a row: lay it out (`fixed_packed_inputs`, the real function) and "capture" its
bucket the first time it is met, as `PackedGraphs.__call__` does. tests/gpu/test_cuda_graph_target.py runs the real
thing in a real `dflash train` on a GPU."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash import train as train_mod
from dflash.data import Schedule
from dflash.target import PackedGraphs, fixed_packed_inputs

BUDGET, MIN_LEN, MAX_LEN = 256, 8, 64


def _trainer(epochs: list[list[list[tuple[int, int, int]]]], fail_at: int | None = None
             ) -> tuple[Any, PackedGraphs, list[int], list[str]]:
    """A Trainer's attributes `_precapture_graphs` reads, its log lines in the returned list."""
    graphs = PackedGraphs(None, BUDGET, MIN_LEN, MAX_LEN, print)  # type: ignore[arg-type]
    ran: list[int] = []  # the bucket of every forward that ran

    def forward(pieces: list[tuple[int, int, int]]) -> None:
        lengths = [n for _, _, n in pieces]
        ids = torch.zeros(1, sum(lengths), dtype=torch.long)
        cu = torch.tensor([0, *itertools.accumulate(lengths)])
        slots = fixed_packed_inputs(ids, cu, BUDGET, MAX_LEN, graphs.buckets).slots
        if slots not in graphs.graphs:
            if fail_at is not None and graphs.captures == fail_at:
                graphs.failed = "OutOfMemoryError: CUDA out of memory"
                return
            graphs.graphs[slots] = (None, {}, torch.empty(0))
            graphs.captures += 1
        ran.append(slots)

    logs: list[str] = []
    t = SimpleNamespace(
        target=SimpleNamespace(graphs=graphs), corpus=object(), device=torch.device("cpu"),
        log=SimpleNamespace(info=lambda fmt, *a: logs.append(fmt % a)),
        cfg=SimpleNamespace(data=SimpleNamespace(token_budget=BUDGET)),
        start=SimpleNamespace(schedule=Schedule(epochs=epochs, fingerprint="f", seed=0, token_budget=BUDGET)),
        phase=lambda name, **extra: logs.append(f"phase {name}: {extra.get('detail')}"), stop_requested=lambda: False,
        _forward=forward)
    return t, graphs, ran, logs


def _buf(*lengths: int) -> list[tuple[int, int, int]]:
    return [(i, 0, n) for i, n in enumerate(lengths)]


@pytest.fixture(autouse=True)
def _stand_in_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_mod, "compute_batch", lambda target, corpus, pieces, budget: _current[0](pieces))


_current: list[Any] = [None]


def _run(t: Any) -> None:
    _current[0] = t._forward
    train_mod.Trainer._precapture_graphs(t)


def test_every_bucket_the_schedule_needs_is_captured_once_in_order_before_training() -> None:
    epochs = [[_buf(64, 64, 64, 64), _buf(*[8] * 20), _buf(100), _buf(*[8] * 14)],  # 16, 32, eager (too long), 16
              [_buf(*[8] * 31), _buf(64, 64)]]                                      # 33, 16
    t, graphs, ran, logs = _trainer(epochs)
    _run(t)
    assert ran == [16, 32, 33] and graphs.captures == 3 and sorted(graphs.graphs) == [16, 32, 33]
    assert logs[0] == "phase loading_target: capturing the target forward for document-slot buckets [16, 32, 33]"
    assert logs[1].startswith("target.cuda_graph: 3 of the 3 buckets the schedule needs [16, 32, 33] captured")
    # training's rows now all replay: none of them would capture
    assert {fixed_packed_inputs(torch.zeros(1, sum(n for *_, n in b), dtype=torch.long),
                                torch.tensor([0, *itertools.accumulate(n for *_, n in b)]), BUDGET, MAX_LEN,
                                graphs.buckets).slots for ep in epochs for b in ep if max(n for *_, n in b) <= MAX_LEN
            } <= set(graphs.graphs)


def test_the_log_names_the_buckets_and_a_failed_capture_stops_there() -> None:
    t, graphs, ran, logs = _trainer([[_buf(64, 64, 64, 64), _buf(*[8] * 20), _buf(*[8] * 31)]], fail_at=1)
    _run(t)
    assert ran == [16] and graphs.captures == 1 and graphs.failed is not None
    messages = logs[1:]
    assert len(messages) == 1 and "1 of the 3 buckets the schedule needs [16, 32, 33] captured before the first step" \
        in messages[0] and "OutOfMemoryError: CUDA out of memory: the target forward runs eagerly" in messages[0]


def test_nothing_runs_without_graphs_or_when_every_bucket_is_captured() -> None:
    t, graphs, ran, logs = _trainer([[_buf(64, 64, 64, 64)]])
    graphs.graphs[16] = (None, {}, torch.empty(0))  # type: ignore[assignment]
    _run(t)
    assert ran == [] and logs == []
    t.target.graphs = None  # CPU, or target.cuda_graph off
    _run(t)
    assert ran == [] and logs == []
