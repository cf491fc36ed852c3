"""The event contract (docs/events.md) as dflash/telemetry.py writes and reads it.

Both halves rely on these properties: every line validates, several writers never interleave, NaN survives.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import re
from pathlib import Path

import pytest

from dflash import telemetry
from dflash.telemetry import EventError, EventWriter, Heartbeat, parse_line, read_events, validate_event

DOC = Path(__file__).resolve().parents[1] / "docs" / "events.md"


def _step_fields(step: int = 1, loss: float = 2.5) -> dict:
    return dict(step=step, epoch=0, loss=loss, acc=[0.5, 0.25], lr=1e-3, grad_norm=1.0, tokens=100,
                tokens_per_s=1000.0, step_time_s=0.1, queue_depth=2, queue_wait_s=0.0, recompiles=0, total_steps=10)


def test_every_kind_in_the_doc_is_in_the_schema_and_back() -> None:
    documented = set(re.findall(r"^### `(\w+)`", DOC.read_text(), flags=re.M))
    assert documented == set(telemetry.KINDS)


def test_required_keys_of_each_kind_are_documented() -> None:
    text = DOC.read_text()
    for kind, spec in telemetry.KINDS.items():
        section = text.split(f"### `{kind}`", 1)[1].split("###", 1)[0]
        for key in spec:
            assert f"`{key}`" in section, f"{kind}.{key} is required by telemetry.py but not documented"


def test_writer_output_validates_and_roundtrips(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventWriter(path, run_id="r1") as w:
        w.emit("phase", phase="loading_target", i=1, n=4)
        w.emit("step", **_step_fields(loss=float("nan")))
        w.emit("run_end", reason="completed", exit_code=0, step=1)
    events = list(read_events(path))
    assert [e["kind"] for e in events] == ["phase", "step", "run_end"]
    assert [e["seq"] for e in events] == [0, 1, 2]
    assert math.isnan(events[1]["loss"])
    assert events[0]["i"] == 1 and events[0]["n"] == 4
    # NaN is written as a string, so every line is strict JSON.
    for raw in path.read_text().splitlines():
        json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_writer_refuses_events_that_break_the_contract(tmp_path: Path) -> None:
    w = EventWriter(tmp_path / "e.jsonl", run_id="r")
    with pytest.raises(EventError, match="missing key 'exit_code'"):
        w.emit("run_end", reason="completed", step=1)
    with pytest.raises(EventError, match="unknown phase"):
        w.emit("phase", phase="warming")
    with pytest.raises(EventError, match="unknown class"):
        w.emit("error", **{"class": "boom", "message": "x", "traceback": None, "fatal": True})
    with pytest.raises(EventError, match="must be bool"):
        w.emit("error", **{"class": "oom", "message": "x", "traceback": None, "fatal": 1})
    w.close()
    assert (tmp_path / "e.jsonl").read_text() == ""


def test_reader_skips_garbage_and_unterminated_tail(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventWriter(path, run_id="r") as w:
        w.emit("phase", phase="training")
    with open(path, "a") as fh:
        fh.write("not json\n")
        fh.write('{"kind": "step"}\n')
        fh.write('{"v":1,"ts":1,"kind":"phase","run_id":"r","rank":0,"seq":9,"phase":"sav')  # writer died mid-line
    stats = telemetry.ReadStats()
    events = list(read_events(path, stats))
    assert len(events) == 1
    assert stats.invalid == 2 and stats.lines == 3


def test_long_traceback_is_cut_from_the_top_to_one_line(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    tb = "".join(f"frame {i}\n" for i in range(20000)) + "RuntimeError: the real cause"
    with EventWriter(path, run_id="r") as w:
        w.emit("error", **{"class": "exception", "message": "boom", "traceback": tb, "fatal": True})
    raw = path.read_bytes()
    assert len(raw) <= telemetry.MAX_LINE_BYTES and raw.count(b"\n") == 1
    (ev,) = read_events(path)
    assert ev["traceback"].endswith("RuntimeError: the real cause")


def _hammer(path: str, rank: int, n: int) -> None:
    w = EventWriter(path, run_id="r", rank=rank)
    for i in range(n):
        w.emit("error", **{"class": "exception", "message": f"{rank}-{i}-" + "x" * 3000, "traceback": None,
                           "fatal": False})
    w.close()


def test_several_processes_append_whole_lines(tmp_path: Path) -> None:
    path = str(tmp_path / "e.jsonl")
    procs = [mp.get_context("spawn").Process(target=_hammer, args=(path, r, 200)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    stats = telemetry.ReadStats()
    events = list(read_events(path, stats))
    assert stats.invalid == 0 and len(events) == 600
    for rank in range(3):
        assert [e["seq"] for e in events if e["rank"] == rank] == list(range(200))


def test_heartbeat_thread_writes_current_state(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    state = {"phase": "compiling", "step": 3}
    w = EventWriter(path, run_id="r")
    hb = Heartbeat(w, lambda: dict(state), interval_s=0.05).start()
    import time

    deadline = time.time() + 5
    while time.time() < deadline and sum(1 for _ in read_events(path)) < 3:
        time.sleep(0.02)
    hb.stop()
    w.close()
    beats = list(read_events(path))
    assert len(beats) >= 3
    assert all(b["kind"] == "heartbeat" and b["phase"] == "compiling" and b["step"] == 3 for b in beats)
    assert beats[0]["rss_mb"] > 1


def test_validate_rejects_bool_where_int_expected() -> None:
    ev = {"v": 1, "ts": 1.0, "kind": "run_end", "run_id": "r", "rank": 0, "seq": 0,
          "reason": "completed", "exit_code": True, "step": 1}
    with pytest.raises(EventError, match="exit_code"):
        validate_event(ev)
    ev["exit_code"] = 0
    assert parse_line(json.dumps(ev))["exit_code"] == 0


def test_a_gpu_rank_s_heartbeat_carries_its_allocator_retries_and_a_cpu_rank_s_null(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dflash.train.Live.heartbeat, the state every heartbeat writes. No GPU exists here, so torch.cuda's three
    counters are stand-ins returning what their documented interface returns (bytes; memory_stats' flat dict with
    "num_alloc_retries"); tests/gpu runs the trainer on a real card."""
    import torch

    from dflash.train import Live

    stats = {"num_alloc_retries": 7, "num_ooms": 0, "allocated_bytes.all.current": 5 * 2**20}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 8 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    gpu = Live(phase="training", step=4, device=torch.device("cuda", 0)).heartbeat()
    assert gpu == {"phase": "training", "step": 4, "gpu_mem_mb": 5.0, "gpu_reserved_mb": 8.0, "gpu_alloc_retries": 7}
    cpu = Live(phase="training", step=4).heartbeat()
    assert cpu["gpu_alloc_retries"] is None and cpu["gpu_mem_mb"] is None
    with EventWriter(tmp_path / "e.jsonl", run_id="r") as w:  # both are valid heartbeats of the contract
        w.emit("heartbeat", rss_mb=1.0, **gpu)
        w.emit("heartbeat", rss_mb=1.0, **cpu)
    assert [e.get("gpu_alloc_retries") for e in read_events(tmp_path / "e.jsonl")] == [7, None]
