"""Tests for preflight kernel inspection on CPU: the fallback is detected as bound, check_kernels refuses it on CUDA.

The fla / causal-conv1d detection branch needs the real wheels and a GPU: tests/gpu/test_gpu_checks.py.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from dflash.kernels import (
    LINEAR_ATTENTION_OPS,
    FlexWarningWatch,
    check_kernels,
    dynamo_counts,
    inspect_kernels,
    varlen_usable,
    versions,
)
from dflash.target import TINY_ARCH, Target, TargetConfig

HAVE_FLA = importlib.util.find_spec("fla") is not None
HAVE_CONV = importlib.util.find_spec("causal_conv1d") is not None
FAST = {
    "chunk_gated_delta_rule": "fla",
    "fused_recurrent_gated_delta_rule": "fla",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
}


@pytest.mark.skipif(HAVE_FLA or HAVE_CONV, reason="this machine has the fast kernels installed")
def test_tiny_qwen3_5_without_kernels_reports_torch_fallback() -> None:
    target = Target(TargetConfig(), num_draft_layers=2, device=torch.device("cpu"))
    assert target.kernels == dict.fromkeys(LINEAR_ATTENTION_OPS, "torch-fallback")
    assert inspect_kernels(target.model) == target.kernels
    assert not varlen_usable(target.kernels)


def test_model_without_linear_attention_reports_absent() -> None:
    arch = {**TINY_ARCH, "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}
    target = Target(TargetConfig(arch=arch), num_draft_layers=1, device=torch.device("cpu"))
    assert target.kernels == dict.fromkeys(LINEAR_ATTENTION_OPS, "absent")
    assert check_kernels(target.kernels, "cuda", allow_slow=False) == []


def test_check_kernels_refuses_fallback_on_cuda_only() -> None:
    slow = dict.fromkeys(LINEAR_ATTENTION_OPS, "torch-fallback")
    problems = check_kernels(slow, "cuda", allow_slow=False)
    assert len(problems) == 4
    assert any("chunk_gated_delta_rule" in p and "flash-linear-attention" in p for p in problems)
    assert any("causal_conv1d_fn" in p and "causal-conv1d" in p for p in problems)
    assert all("--allow-slow-kernels" in p for p in problems)
    assert check_kernels(slow, "cpu", allow_slow=False) == []
    assert check_kernels(slow, torch.device("cuda:3"), allow_slow=True) == []
    assert check_kernels(FAST, "cuda:0", allow_slow=False) == []
    half = {**FAST, "causal_conv1d_update": "torch-fallback"}
    assert len(check_kernels(half, "cuda", allow_slow=False)) == 1
    assert varlen_usable(FAST) and not varlen_usable(half | {"causal_conv1d_fn": "torch-fallback"})


def test_check_kernels_refuses_uncompiled_flex_on_cuda() -> None:
    assert check_kernels({**FAST, "attention": "flex-compiled"}, "cuda", allow_slow=False) == []
    problems = check_kernels({**FAST, "attention": "flex-eager"}, "cuda", allow_slow=False)
    assert len(problems) == 1 and "uncompiled" in problems[0]


def test_versions_report_missing_kernels_as_none() -> None:
    v = versions()
    assert v["torch"] == torch.__version__
    assert v["python"].count(".") == 2
    import transformers

    assert v["transformers"] == transformers.__version__
    if not HAVE_FLA:
        assert v["fla"] is None
    if not HAVE_CONV:
        assert v["causal_conv1d"] is None


def _eager_flex_call() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 8, 16)
    flex_attention(q, q, q)


def test_flex_warning_watch_catches_uncompiled_flex_every_time() -> None:
    seen: list[str] = []
    for _ in range(2):  # torch warns once per process; the watch must re-arm it
        with FlexWarningWatch(on_trigger=seen.append) as watch:
            _eager_flex_call()
        assert len(watch.triggered) == 1 and "without torch.compile" in watch.triggered[0]
    assert len(seen) == 2
    with FlexWarningWatch() as quiet:
        torch.ones(3).sum()
    assert quiet.triggered == []


def test_flex_warning_watch_passes_other_warnings_on() -> None:
    with pytest.warns(UserWarning, match="unrelated"):
        with FlexWarningWatch() as watch:
            warnings.warn("unrelated warning", UserWarning, stacklevel=1)
    assert watch.triggered == []


def test_dynamo_counts_grow_on_recompile() -> None:
    before = dynamo_counts()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    f(torch.ones(3))
    mid = dynamo_counts()
    f(torch.ones(3))
    assert dynamo_counts() == mid  # same shape: no new graph
    f(torch.ones(5))
    after = dynamo_counts()
    assert mid["unique_graphs"] > before["unique_graphs"] and after["unique_graphs"] > mid["unique_graphs"]


_FALLBACK_SCRIPT = """
import sys, torch
from dflash.target import Target, TargetConfig
ids = torch.randint(0, 100, (1, 12))
if sys.argv[1] == "dflash":
    t = Target(TargetConfig(), num_draft_layers=1, device=torch.device("cpu"))
    t.hidden_states(ids, torch.ones_like(ids))
elif sys.argv[1] == "eval":  # what `dflash eval` builds: the model alone, through dflash's builder
    from dflash.target import build_target_model
    build_target_model(TargetConfig(), 100, device=torch.device("cpu"), dtype=torch.float32)(input_ids=ids)
else:  # the same model through transformers alone: what its notice looks like without dflash
    from transformers import AutoModelForCausalLM
    from dflash.target import target_hf_config
    AutoModelForCausalLM.from_config(target_hf_config(TargetConfig(), 100))(input_ids=ids)
"""


def test_transformers_fallback_notice_is_not_printed_for_a_cpu_target() -> None:
    """A fresh process each (transformers prints it once per op and process): the model alone prints it on this
    transformers, the same model built as dflash's CPU target does not; other transformers warnings still pass."""
    import logging
    import subprocess
    import sys

    from dflash.kernels import FALLBACK_NOTICE, HUB_KERNELS_LOGGER

    plain = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT, "plain"], capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr[-2000:]
    if FALLBACK_NOTICE not in plain.stderr:
        pytest.skip("this transformers prints no fallback notice")
    for how in ("dflash", "eval"):
        ours = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT, how], capture_output=True, text=True,
                              timeout=300)
        assert ours.returncode == 0, ours.stderr[-2000:]
        assert FALLBACK_NOTICE not in ours.stderr + ours.stdout, (how, ours.stderr[-2000:])
    from dflash.kernels import quiet_expected_fallback_notice

    quiet_expected_fallback_notice("cpu")
    quiet_expected_fallback_notice("cpu")  # idempotent: one filter

    def passes(msg: str) -> bool:
        record = logging.LogRecord(HUB_KERNELS_LOGGER, logging.WARNING, "", 0, msg, None, None)
        return logging.getLogger(HUB_KERNELS_LOGGER).filter(record)

    assert len(logging.getLogger(HUB_KERNELS_LOGGER).filters) == 1
    assert not passes(f"`chunk_gated_delta_rule` {FALLBACK_NOTICE} because ...") and passes("another warning")
