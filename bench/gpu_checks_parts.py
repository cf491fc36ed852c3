"""The GPU checks of tests/gpu split into parts that each fit one device call (at most 540 s on a fresh H200).

One device call is limited to 600 s; since issue 24 the whole of tests/gpu no longer fits (16 of 18 checks ran in
570 s). `bench/gpu_checks.sh PART` reads this table (`--ids PART`) and runs each check of the part in its own pytest
process, so one crashed or hung check never hides the others and the part's summary line always prints.

Estimates are seconds on a *fresh* machine, per check, run alone in its own process: the figure recorded in
docs/gpu-checks.md where there is one (its run and the test's own duration), else a guess marked "guess" (those
checks were never timed alone; the guess counts the Triton / inductor compile the check pays on a cold machine).
A part's estimate adds PROCESS_S per check (python + torch + transformers import) and SETUP_S once (wheel install,
device line). tests/test_gpu_checks_parts.py keeps every collected check in exactly one part and every part under
PART_LIMIT_S; a new GPU check must be added here (the test names it otherwise).

Usage: python3 bench/gpu_checks_parts.py --list | --ids PART | --parts
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

PART_LIMIT_S = 540  # one device call is 600 s; 60 s margin for start-up and copying $OUT back
PROCESS_S = 12  # one pytest process: interpreter, torch, transformers imports (measured ~10-15 s on the H200)
SETUP_S = 20  # pip install of the wheels into /tmp/site, nvidia-smi, version line

G = "tests/gpu/test_gpu_checks.py::"
F = "tests/gpu/test_flex_training_size.py::"
T = "tests/gpu/test_tau_gpu.py::"
C = "tests/gpu/test_cuda_graph_target.py::"
K = "tests/gpu/test_fla_configs_gpu.py::"
U = "tests/gpu/test_target_fusion_gpu.py::"
R = "tests/gpu/test_recipe_options_gpu.py::"


@dataclass(frozen=True)
class Check:
    """One pytest node id run as one process; `fla` False runs it without the fla / causal-conv1d wheels."""

    node: str
    seconds: int
    source: str  # where the estimate comes from
    fla: bool = True


PARTS: dict[str, tuple[Check, ...]] = {
    # fla bf16 target checks: they share fla's bf16 JIT (paid by the first), plus the no-wheels pass.
    "part1": (
        Check(G + "test_kernels_bound_match_the_installed_packages", 17, "run 1 pass 1: 17.2 s", fla=False),
        Check(G + "test_kernels_bound_match_the_installed_packages", 16, "run 1 pass 2: 15.4 s"),
        Check(G + "test_fla_varlen_target_equals_padded[bfloat16-0.02]", 80, "run 1: 76.7 s, run 6: 71.1 s"),
        Check(G + "test_target_attention_options_equal_padded_per_document[sdpa]", 60,
              "2026-12-05 s19: 19 s, H100 warmed by a 4B run; kept high for a cold H200"),
        Check(G + "test_target_attention_options_equal_padded_per_document[varlen]", 60, "2026-12-05 s19: 18 s, see above"),
        Check(G + "test_default_attention_is_varlen_for_packed_training_and_sdpa_for_decoding", 60,
              "2026-12-05 s19: 26 s, see above"),
        Check(G + "test_regen_batch_at_the_cuda_rows_cap_decodes", 90, "2026-12-05 s19: 44 s, see above"),
    ),
    # float32 kernels: fla's float32 JIT is separate from bf16's.
    "part2": (
        Check(G + "test_fla_varlen_target_equals_padded[float32-0.002]", 110, "run 1: 95.9 s, run 6: 106.0 s"),
        Check(G + "test_exact_float32_kernels_make_chunked_and_recurrent_logits_agree", 180,
              "2026-12-05 s19: 173 s on a warm H100"),
        Check(T + "test_teacher_forced_drafts_and_walk_equal_the_decode_loop_on_the_gpu[float32-exact]", 150,
              "2026-12-04: 146.4 s alone"),
    ),
    # flex attention and the compiled drafter: they share inductor's compiles of flex.
    "part3": (
        Check(G + "test_flex_equals_dense_forward_and_grads[bf16-0.02-64]", 55, "run 6: 54.8 s (compiles flex); s20: 38 s, H100"),
        Check(G + "test_flex_equals_dense_forward_and_grads[bf16-0.02-256]", 50, "run 1: 25.5 s; s20: 48 s, H100"),
        Check(G + "test_flex_equals_dense_forward_and_grads[fp32-0.002-64]", 30, "run 1: 27.8 s"),
        Check(G + "test_flex_equals_dense_forward_and_grads[fp32-0.002-256]", 25, "run 1: 20.0 s"),
        Check(G + "test_compiled_flex_does_not_recompile_across_buffers", 40, "2026-12-06 s20: 21 s alone, H100"),
        Check(G + "test_whole_drafter_under_torch_compile_matches_and_does_not_recompile", 85, "run 2: 82.5 s; s20: 53 s"),
        Check(G + "test_training_size_flex_equals_dense_and_step_cost", 45, "run 2: 17.3 s after the above; s20: 42 s alone"),
    ),
    # the bench-shape gradient checks (2026-12-05, warm H200: the three passed in 195.9 s in one pytest process)
    "part4": (
        Check(F + "test_flex_gradients_equal_dense_at_the_bench_training_shape[flex-module]", 80,
              "2026-12-05: the three in 195.9 s together, warm machine; cold adds the flex compile"),
        Check(F + "test_flex_gradients_equal_dense_at_the_bench_training_shape[whole-step-compiled]", 110,
              "2026-12-05: see above"),
        Check(F + "test_flex_gradients_equal_dense_at_the_bench_training_shape[regional-compiled]", 110,
              "2026-12-05: see above (passed)"),
    ),
    "part5": (
        Check(T + "test_teacher_forced_drafts_and_walk_equal_the_decode_loop_on_the_gpu[bf16-autocast]", 200,
              "2026-12-05: 107 s alone, fresh machine; passes under the tie rule (both cases 204.6 s)"),
        Check(C + "test_graph_replay_equals_the_eager_forward_exactly", 120, "2026-12-05: both 48.4 s together, fresh machine"),
        Check(C + "test_a_different_document_count_replays_without_recapture", 60, "2026-12-05: see above"),
        # from part2 in session 19 (its float32 check took 173 s, not the guessed 110)
        Check(G + "test_load_from_directory_onto_the_gpu", 60, "run 4: 68 s incl. start-up; s20: 19 s, passed under 5.25"),
    ),
    # alone: it compiles a flex drafter step per shape, more shapes than the recompile limit
    "part6": (
        Check(G + "test_compiled_flex_over_more_shapes_than_the_recompile_limit_never_falls_back", 150,
              "2026-12-05 16:55: 102 s on a fresh H100 (3 shapes; 4 did not finish in 260 s on the H200)"),
        # moved from part5 (533 s estimated) once part6's check was timed
        Check(U + "test_fused_packed_forward_equals_eager_to_bf16_rounding", 110,
              "2026-12-05: 80.7 s alone on an H100 with fla's bf16 JIT cached on disk; cold, fla's JIT adds ~30 s"),
        Check(C + "test_dflash_train_captures_every_bucket_its_schedule_needs_before_the_first_step", 120,
              "2026-12-05 s19: 60.1 s on a fresh H100 after a 4B run (an 8-step uncompiled dflash train)"),
    ),
    # fla's tuned configs: each check starts processes with empty Triton caches (two cold fla JITs, one autotuned);
    # and the CUDA graph over the fused kernels
    "part7": (
        Check(K + "test_recorded_configs_skip_autotuning_and_give_the_same_hidden_states", 120,
              "2026-12-05: 91 s, then 103 s, on an H100 (its own empty Triton caches: a fresh machine costs the same)"),
        Check(K + "test_dflash_train_records_after_its_first_step_and_the_next_run_loads", 160,
              "2026-12-05: 127 s, then 141 s, on an H100 (empty Triton caches of its own)"),
        Check(U + "test_a_captured_graph_replays_the_fused_kernels", 100,
              "2026-12-05 17:00: 73 s on an H100, after the two checks above in the same call"),
    ),
    # issue 40's recipe options in the compiled training step (tiny target, 40 steps each)
    "part8": (
        Check(R + "test_a_recipe_option_trains_compiled_without_recompiles[dpace]", 90, "guess: one cold compile"),
        Check(R + "test_a_recipe_option_trains_compiled_without_recompiles[document]", 90, "guess: one cold compile"),
        Check(R + "test_a_recipe_option_trains_compiled_without_recompiles[muon]", 90, "guess: one cold compile"),
    ),
    "part9": (
        Check(G + "test_flex_equals_dense_under_each_sliding_rule[True-query]", 60, "guess: one cold compile"),
        Check(G + "test_flex_equals_dense_under_each_sliding_rule[False-anchor]", 60, "guess: one cold compile"),
        Check(G + "test_flex_equals_dense_under_each_sliding_rule[True-anchor]", 60, "guess: one cold compile"),
    ),
}


def part_seconds(part: str) -> int:
    """A part's estimate on a fresh machine: its checks, one process start each, and the set-up once."""
    return SETUP_S + sum(c.seconds + PROCESS_S for c in PARTS[part])


def listing() -> str:
    lines = [f"parts of bench/gpu_checks.sh (each <= {PART_LIMIT_S} s on a fresh H200; estimates in seconds)"]
    for name, checks in PARTS.items():
        lines.append(f"{name}  {part_seconds(name)} s  ({len(checks)} checks)")
        for c in checks:
            wheels = "" if c.fla else "  [without fla / causal-conv1d]"
            lines.append(f"  {c.seconds:4d}  {c.node}{wheels}  ({c.source})")
    total = sum(part_seconds(p) for p in PARTS)
    lines.append(f"all  {total} s  (every part in turn: more than one device call)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--list", action="store_true", help="print every part with its checks and estimates")
    g.add_argument("--parts", action="store_true", help="print the part names, one a line")
    g.add_argument("--ids", metavar="PART", help="print PART's checks as 'fla|nofla SECONDS NODE', one a line")
    args = p.parse_args(argv)
    if args.list:
        print(listing())
    elif args.parts:
        print("\n".join(PARTS))
    else:
        if args.ids not in PARTS:
            print(f"gpu_checks: unknown part {args.ids!r}; the parts are {', '.join(PARTS)} (or all)", file=sys.stderr)
            return 2
        for c in PARTS[args.ids]:
            print(f"{'fla' if c.fla else 'nofla'} {c.seconds} {c.node}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
