"""End-to-end tests of `dflash.train` on CPU: the loss falls, events follow the contract, SIGTERM + resume is exact.

Runs are in-process (one torch import for the module) with the real tiny qwen3_5 target and the real drafter.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from dflash_fixtures import run_config

from dflash.checkpoint import list_checkpoints, load_file
from dflash.telemetry import ReadStats, read_events, validate_event
from dflash.train import TrainResult, UsageError, loaded_kernel_problems, lr_lambda, train


def _events(out: Path) -> list[dict]:
    stats = ReadStats()
    evs = list(read_events(out / "events.jsonl", stats))
    assert stats.invalid == 0, stats.errors
    assert stats.lines == len(evs)
    return evs


def test_loss_falls_and_event_stream_follows_the_contract(tmp_path: Path) -> None:
    cfg = run_config(train={"max_steps": 40, "checkpoint_every": 15, "keep_last": 5})
    res = train(cfg, tmp_path)
    assert (res.exit_code, res.reason, res.step) == (0, "completed", 40)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < first - 0.25, f"loss did not fall: {first:.3f} -> {last:.3f}"

    evs = _events(tmp_path)
    for raw in (tmp_path / "events.jsonl").read_text().splitlines():
        assert raw.endswith("}")  # whole lines only
    for e in evs:
        validate_event(e)
    kinds = [e["kind"] for e in evs if e["kind"] != "heartbeat"]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    # heartbeats may come first (they show life while the data is prepared); run_start is the first run event
    start, end = next(e for e in evs if e["kind"] != "heartbeat"), evs[-1]
    assert start["kind"] == "run_start" and start["total_steps"] == 40 and start["resumed_from"] is None
    assert start["kernels"]["chunk_gated_delta_rule"] == "torch-fallback" and start["kernels"]["attention"] == "dense"
    assert start["roles"] == {"colocated": [0]} and start["config"]["train"]["max_steps"] == 40
    assert end == {**end, "reason": "completed", "exit_code": 0, "step": 40}
    phases = [e["phase"] for e in evs if e["kind"] == "phase"]
    assert phases.index("loading_target") < phases.index("building_drafter") < phases.index("training")
    assert phases.count("training") == 1
    first_step = kinds.index("step")
    assert kinds.index("phase") < first_step and "training" in phases[: kinds[:first_step].count("phase")]
    steps = [e for e in evs if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 41))
    assert all(len(e["acc"]) == 3 and e["tokens"] > 0 and e["queue_depth"] <= 3 for e in steps)
    assert steps[0]["lr"] < steps[4]["lr"]  # warm-up
    ckpts = [e for e in evs if e["kind"] == "checkpoint"]
    assert [c["step"] for c in ckpts] == [15, 30, 40]
    assert all(Path(c["path"]).is_dir() for c in ckpts)
    assert any(e["kind"] == "heartbeat" for e in evs)
    log = (tmp_path / "train.log").read_text()
    assert "step 40/40" in log and "run_end: completed" in log
    # the kernels the loaded model bound were checked against the early (meta-device) probe: equal on CPU
    assert "loaded target binds the kernels the probe saw" in log
    assert not [e for e in evs if e["kind"] == "error"]


def _params(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt_dir, "drafter.pt")


def test_sigterm_then_resume_is_bit_identical(tmp_path: Path) -> None:
    n = 4
    cfg = run_config(train={"max_steps": 2 * n, "checkpoint_every": 0})
    straight = train(cfg, tmp_path / "a")

    def sigterm_at_n(step: int, _loss: float) -> None:
        if step == n:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled by the run's own handler

    b = tmp_path / "b"
    stopped = train(cfg, b, on_step=sigterm_at_n)
    assert (stopped.exit_code, stopped.reason, stopped.step) == (0, "signal", n)
    assert [s for s, _ in list_checkpoints(b)] == [n]
    resumed: TrainResult = train(cfg, b, resume=True)
    assert (resumed.exit_code, resumed.reason, resumed.step) == (0, "completed", 2 * n)
    assert resumed.losses == straight.losses[n:]  # exactly, not approximately
    pa, pb = _params(tmp_path / "a" / "checkpoints" / f"step-{2 * n}"), _params(b / "checkpoints" / f"step-{2 * n}")
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k

    evs = _events(b)
    ends = [e for e in evs if e["kind"] == "run_end"]
    assert [(e["reason"], e.get("signal"), e["step"]) for e in ends] == [("signal", "SIGTERM", n),
                                                                        ("completed", None, 2 * n)]
    starts = [e for e in evs if e["kind"] == "run_start"]
    assert [s["resumed_from"] for s in starts] == [None, n]
    # the resumed run consumed exactly the buffers the uninterrupted one did, in the same order
    assert [e["buffer"] for e in evs if e["kind"] == "step"] == \
        [e["buffer"] for e in _events(tmp_path / "a") if e["kind"] == "step"]
    assert len({e["run_id"] for e in evs}) == 1


def test_existing_checkpoints_need_resume_and_resume_needs_a_checkpoint(tmp_path: Path) -> None:
    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 0})
    res = train(cfg, tmp_path / "empty", resume=True)
    assert (res.exit_code, res.reason) == (2, "error")
    err = [e for e in _events(tmp_path / "empty") if e["kind"] == "error"]
    assert err[0]["class"] == "config" and "no checkpoint" in err[0]["message"]
    train(cfg, tmp_path / "r")
    with pytest.raises(UsageError, match="pass --resume"):
        train(cfg, tmp_path / "r")


def test_nan_loss_is_a_fatal_error_event(tmp_path: Path) -> None:
    cfg = run_config(train={"lr": 1e30, "max_steps": 6, "checkpoint_every": 0, "grad_clip": 1e30})
    res = train(cfg, tmp_path)
    evs = _events(tmp_path)
    errors = [e for e in evs if e["kind"] == "error"]
    assert res.exit_code == 1 and res.reason == "error"
    assert errors and errors[0]["class"] == "nan" and errors[0]["fatal"] is True
    ends = [e for e in evs if e["kind"] == "run_end"]
    assert len(ends) == 1 and ends[0]["reason"] == "error" and ends[0]["exit_code"] == 1


def test_lr_schedule_warms_up_then_decays_to_floor() -> None:
    f = lr_lambda(100, 0.1, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


def test_failure_mid_run_is_a_classified_error_event_with_traceback(tmp_path: Path) -> None:
    def fail(step: int, _loss: float) -> None:
        if step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    res = train(run_config(train={"max_steps": 5, "checkpoint_every": 0}), tmp_path, on_step=fail)
    assert (res.exit_code, res.reason, res.step) == (1, "error", 2)
    evs = _events(tmp_path)
    err = [e for e in evs if e["kind"] == "error"]
    assert len(err) == 1 and err[0]["class"] == "oom" and err[0]["fatal"] is True
    assert "OutOfMemoryError" in err[0]["traceback"] and "fail" in err[0]["traceback"]
    assert evs[-1]["kind"] == "run_end" and evs[-1]["reason"] == "error" and evs[-1]["exit_code"] == 1


def test_error_classes() -> None:
    from dflash.train import classify_error

    assert classify_error(RuntimeError("CUDA error: out of memory")) == "oom"
    assert classify_error(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error")) == "nccl"
    assert classify_error(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                      "waiting 20000ms for recv operation to complete")) == "nccl"
    assert classify_error(KeyError("x")) == "exception"


def test_compiled_step_enters_compiling_then_training_and_never_recompiles(tmp_path: Path) -> None:
    """The compile plumbing on CPU (dynamo tracing, eager backend: no C++ toolchain needed): buffers of different
    content but one fixed shape must not recompile after the first step."""
    import torch._dynamo

    torch._dynamo.reset()
    cfg = run_config(train={"max_steps": 4, "checkpoint_every": 0, "compile": "true", "compile_backend": "eager"})
    res = train(cfg, tmp_path)
    assert res.exit_code == 0
    evs = _events(tmp_path)
    phases = [e["phase"] for e in evs if e["kind"] == "phase"]
    assert phases.index("compiling") < phases.index("training")
    kinds = [e["kind"] if e["kind"] != "phase" else e["phase"] for e in evs if e["kind"] != "heartbeat"]
    assert kinds.index("compiling") < kinds.index("training") < kinds.index("step")
    steps = [e for e in evs if e["kind"] == "step"]
    assert [e["recompiles"] for e in steps] == [0, 0, 0, 0]
    assert not [e for e in evs if e["kind"] == "error"]
    torch._dynamo.reset()


def test_resume_from_another_spelling_of_out_and_after_the_run_dir_moved(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer lives in OUT/tokenizer; the schedule must not depend on the path it was loaded from."""
    import shutil

    cfg = run_config(data={"tokenizer_cache": None}, train={"max_steps": 2, "checkpoint_every": 0})
    monkeypatch.chdir(tmp_path)
    assert train(cfg, "rel").exit_code == 0
    assert any((tmp_path / "rel" / "tokenizer").iterdir())
    res = train(cfg, tmp_path / "rel", resume=True, max_steps=3)  # relative, then absolute
    assert (res.exit_code, res.reason, res.step) == (0, "completed", 3)
    shutil.move(tmp_path / "rel", tmp_path / "moved")
    res = train(cfg, tmp_path / "moved", resume=True, max_steps=4)
    assert (res.exit_code, res.reason, res.step) == (0, "completed", 4)
    shutil.copytree(tmp_path / "moved", tmp_path / "copy")
    res = train(cfg, tmp_path / "copy", resume=True, max_steps=5)
    assert (res.exit_code, res.reason, res.step) == (0, "completed", 5)
    starts = [e["resumed_from"] for e in _events(tmp_path / "copy") if e["kind"] == "run_start"]
    assert starts == [None, 2, 3, 4]


def test_loaded_kernels_must_match_the_probe_and_pass_the_kernel_check() -> None:
    """run_start names the probe's kernels; the loaded model must bind the same ones, and fast ones on a GPU."""
    fast = {"chunk_gated_delta_rule": "fla", "fused_recurrent_gated_delta_rule": "fla",
            "causal_conv1d_fn": "causal_conv1d", "causal_conv1d_update": "causal_conv1d"}
    probed = {**fast, "attention": "flex-compiled"}
    assert loaded_kernel_problems(probed, dict(fast), "cuda", False) == []
    slow = {**fast, "chunk_gated_delta_rule": "torch-fallback"}
    problems = loaded_kernel_problems(probed, slow, "cuda", False)
    assert problems == [
        "chunk_gated_delta_rule: the loaded target binds torch-fallback, the preflight probe saw fla",
        "chunk_gated_delta_rule runs torch-fallback on cuda (install flash-linear-attention, or pass "
        "--allow-slow-kernels)"]
    # allowed slow kernels: the difference is still reported (run_start said otherwise), the fallback is not
    assert loaded_kernel_problems(probed, slow, "cuda", True) == problems[:1]
    # a kernel the probe did not see at all
    assert loaded_kernel_problems(probed, {**fast, "extra_op": "hub:x"}, "cuda", False) == [
        "extra_op: the loaded target binds hub:x, the preflight probe saw nothing"]
    # the uncompiled drafter attention is a GPU problem even when the target's kernels agree
    assert loaded_kernel_problems({**fast, "attention": "flex-eager"}, dict(fast), "cuda", False)[0].startswith(
        "drafter attention runs flex-eager on cuda")
    # on CPU the fallback is the only implementation: equal kernels are no problem
    cpu = dict.fromkeys(fast, "torch-fallback")
    assert loaded_kernel_problems({**cpu, "attention": "dense"}, dict(cpu), "cpu", False) == []


def test_fresh_checks_the_whole_config_before_deleting_anything(tmp_path: Path) -> None:
    """A config changed in code (not through config_from_dict) is checked again, before --fresh deletes."""
    from dflash.config import ConfigError

    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 1})
    assert train(cfg, tmp_path).exit_code == 0
    events = (tmp_path / "events.jsonl").read_bytes()
    for field, value, msg in [("block_size", 0, "drafter.block_size: must be >= 2, got 0"),
                              ("hidden_size", 48, "drafter.hidden_size: must equal the target hidden size 32")]:
        bad = run_config(train={"max_steps": 2, "checkpoint_every": 1})
        setattr(bad.drafter, field, value)
        with pytest.raises(ConfigError, match=f"^<test>: {msg}"):
            train(bad, tmp_path, fresh=True)
        assert sorted(s for s, _ in list_checkpoints(tmp_path)) == [1, 2]
        assert (tmp_path / "events.jsonl").read_bytes() == events


def test_arch_vocab_size_below_the_tiny_tokenizers_size_is_a_config_error() -> None:
    """The tiny BPE may use up to data.vocab_size ids; an embedding with fewer rows is refused before the run starts,
    naming the field; more rows (a real target's LM-head cost) pass."""
    from dflash.config import ConfigError, check_run

    small = run_config(target={"arch": {"num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 300}})
    with pytest.raises(ConfigError, match=r"target.arch.vocab_size: must be at least the tiny tokenizer's "
                                          r"data.vocab_size \(512\).*got 300"):
        check_run(small, "cpu")
    big = run_config(target={"arch": {"num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 248_320}})
    check_run(big, "cpu")


def test_a_dynamo_fallback_in_a_step_becomes_an_error_event(tmp_path: Path) -> None:
    """What the train loop does with a real recompile-limit fallback seen by its watch: one contract `error` event
    per fallback, `uncompiled_flex` when flex went eager, `recompile` for any other compiled code."""
    import logging
    import types

    from torch._dynamo import config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.kernels import FlexWarningWatch
    from dflash.model import isolated_compile
    from dflash.telemetry import EventWriter
    from dflash.train import Trainer

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    flex, plain = (isolated_compile(f, backend="eager", dynamic=False) for f in (flex_attention, scaled))
    with dynamo_config.patch(recompile_limit=1), FlexWarningWatch() as watch:
        for m in (16, 32):
            q = torch.randn(1, 1, m, 8)
            flex(q, q, q)
            plain(q)
    assert len(watch.fallbacks) == 2
    writer = EventWriter(tmp_path / "events.jsonl", "r1")
    host = types.SimpleNamespace(emit=lambda kind, **f: writer.emit(kind, **f), log=logging.getLogger("t"),
                                 _flex_warned=False)
    Trainer._report_fallbacks(host, watch)  # type: ignore[arg-type]
    writer.close()
    events = list(read_events(tmp_path / "events.jsonl"))
    assert [(e["kind"], e["class"], e["fatal"]) for e in events] == [
        ("error", "uncompiled_flex", False), ("error", "recompile", False), ("error", "uncompiled_flex", False)]
    assert "flex_attention" in events[0]["message"] and "scaled" in events[1]["message"]
    assert "without torch.compile" in events[2]["message"]  # flex's own warning, from its eager fallback
