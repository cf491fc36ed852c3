"""Shared pytest fixtures: a real OpenSSH sshd on 127.0.0.1, the Proxmox `pct` stand-in, and its containers; and the
suite's layout under pytest-xdist (`./dev test` runs it on several workers): groups, order, the tiny default prebuilt.

Session-scoped where start-up costs time (sshd, key generation), function-scoped where tests change state. Under xdist
every worker is its own session: its own sshd (a free port), its own `pct` state and temp dirs (basetemp/popen-gwN);
tmux servers are per run (a socket in the run's state dir), so nothing of one worker is visible to another. What the
workers do share is content-addressed or locked by the product itself: ~/.cache/dflash (targets, regenerated records,
held-out sets: one writer per entry through dflash/locks.py) and the tiny tokenizer cache (written by rename).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
# Compiled runs in tests start from their own caches: no artifacts shared through this host's compile cache
# ($DFLASH_CACHE/compile-cache), which would make one test's cold compile depend on another having run.
# tests/test_warm_start.py turns it on where that is what it checks.
os.environ["DFLASH_HOST_COMPILE_CACHE"] = "0"

from harness.sshd import PctHost, Sshd, make_pct_host, start_sshd  # noqa: E402

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under xdist; None in a plain `pytest` process
if WORKER is not None:
    # Several workers (and their child trainers) share the cores: torch's OpenMP pool of one thread per core then
    # spins while others need the CPU (measured: 28 % less CPU time for the same tests with one thread). Before
    # torch is imported; children inherit it; an OMP_NUM_THREADS of yours is kept.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Files of many light tests that share one costly module-scoped fixture (a trained and exported run, a built wheel, a
# group run, a compiled run): under xdist each runs on one worker (`--dist loadgroup`), so the fixture is built once,
# not once on every worker that gets one of its tests. (Files whose tests are each heavy, like test_eval.py, are not
# grouped: spreading them wins more than their small fixture costs again.)
SHARED_FIXTURE_FILES = frozenset({
    "test_builtin_tiny.py", "test_export.py", "test_export_check.py", "test_group_export.py", "test_init_from.py",
    "test_peer_bench.py", "test_regen.py", "test_tau.py", "test_warm_start.py",
})

# Files whose tests launch configs/tiny.yaml itself (tests/runs/agentlib.py build_tiny_default): its pretrained target
# and regenerated records are built once per machine into ~/.cache/dflash, about 90 s of 2 cores on a fresh one.
TINY_DEFAULT_FILES = frozenset({"test_builtin_tiny.py", "test_launch.py", "test_opsctl_init.py", "test_tui.py"})

# The slowest tests (FILE::FUNCTION, every parametrization; measured under xdist on 2 cores, docs/development.md):
# marked `slow` here, so `pytest -m "not slow"` leaves them out while working, and started first under xdist, so none
# of them is the last thing a worker still runs when the others are done. A new test of over ~20 s belongs here (or
# gets @pytest.mark.slow in its file).
SLOW_TESTS = frozenset({
    "test_builtin_tiny.py::test_builtin_tiny_run_starts_from_an_installed_package_outside_the_checkout",
    "test_cli.py::test_fresh_with_a_bad_config_deletes_no_checkpoint_and_keeps_the_events",
    "test_cli.py::test_signal_before_the_first_step_stops_at_the_phase_boundary_without_loading",
    "test_cli.py::test_sigterm_finishes_step_checkpoints_and_exits_0",
    "test_compile_scope.py::test_regional_compile_under_ddp_gives_the_eager_ddp_losses",
    "test_compile_scope.py::test_regional_inductor_run_saves_artifacts_its_resume_loads_and_hits",
    "test_compile_scope.py::test_step_phases_cpu_smoke_measures_the_regional_first_step_and_its_split",
    "test_compile_scope.py::test_step_phases_grad_checkpoint_override_sets_the_recompute_and_hfu",
    "test_data_safety.py::test_a_copied_cache_finds_its_regenerated_records",
    "test_data_safety.py::test_a_damaged_cached_target_is_rebuilt_naming_the_file",
    "test_data_safety.py::test_a_second_trainer_on_the_same_out_is_refused_naming_the_first_and_a_killed_one_leaves_no_lock",
    "test_data_safety.py::test_an_entry_of_an_older_dflash_is_adopted_when_whole",
    "test_data_safety.py::test_regen_records_cut_at_a_line_boundary_are_regenerated",
    "test_data_safety.py::test_two_runs_at_once_on_a_fresh_cache_build_the_target_once_and_the_second_reuses_it",
    "test_eval.py::test_eval_json_on_a_trained_checkpoint",
    "test_eval.py::test_evaluate_reports_a_broken_rollback_with_its_position",
    "test_eval.py::test_fast_path_matches_slow_reference",
    "test_eval.py::test_hybrid_target_lossless_at_every_acceptance_length",
    "test_eval_progress.py::test_decode_on_a_pipe_progress_per_prompt_and_an_unwrapped_table",
    "test_flops.py::test_both_benches_run_end_to_end_in_a_cpu_smoke_run",
    "test_flops.py::test_step_phases_dry_run_prints_the_flops_model_and_refuses_a_gpu_run_without_one",
    "test_flops.py::test_step_phases_keeps_the_first_target_layers_with_taps_spread_over_them",
    "test_group.py::test_a_group_that_always_crashes_stops_after_max_and_a_kill_cancels_a_restart",
    "test_group.py::test_a_group_whose_node_crashes_once_is_restarted_as_a_whole",
    "test_group.py::test_colocated_group_kill_leaves_nothing_and_a_dead_node_crashes_the_group",
    "test_group.py::test_colocated_group_run_equals_the_single_node_run_of_the_same_world_size",
    "test_group.py::test_history_of_an_unfollowed_group_crash_names_the_node_and_reason_status_names",
    "test_group.py::test_split_group_run_is_ready_on_both_nodes_and_equals_the_colocated_losses",
    "test_group_export.py::test_follow_writes_node0_steps_and_every_nodes_ranks_without_collision",
    "test_group_refused.py::test_a_supervised_group_whose_node_refuses_is_never_restarted_and_reads_refused",
    "test_group_supervisor.py::test_a_second_supervisor_is_refused_and_starts_nothing",
    "test_history.py::test_history_and_status_of_an_ended_and_cleaned_run",
    "test_history.py::test_history_of_launches_kills_crashes_refusals_and_extra_args",
    "test_kernels.py::test_transformers_fallback_notice_is_not_printed_for_a_cpu_target",
    "test_launch.py::test_real_tiny_run_ready_then_kill_writes_checkpoint",
    "test_layout.py::test_each_module_imports_alone",
    "test_model.py::test_compiled_flex_over_more_shapes_than_the_recompile_limit_never_falls_back",
    "test_model.py::test_the_whole_flex_drafter_compiles_as_one_graph",
    "test_opsctl_export.py::test_a_long_export_shows_its_progress_on_a_terminal",
    "test_speculative_sampling.py::test_speculative_sampling_matches_the_target_distribution",
    "test_tui.py::test_watch_in_tmux_over_ssh_pct_live_run_then_kill_from_the_dashboard",
    "test_warm_start.py::test_a_new_run_of_the_same_graph_starts_warm_from_this_host_s_copy",
})


# The heaviest scheduling units, with their seconds (`--durations` under xdist on 2 cores, 2026-12-07, a shared
# machine: only their order counts): a SHARED_FIXTURE_FILES file is one unit (its fixture and every test of it), any
# other test its own. Handed out heaviest first, so that the longest chains start at once, each on its own worker
# (files come alphabetically otherwise: test_peer_bench.py and test_warm_start.py, the two longest, had started after
# 8 minutes, behind other slow tests on a worker that still had to run them).
HEAVY = {
    "test_peer_bench.py": 600,
    "test_warm_start.py": 500,
    "test_dev_demo.py::test_dev_demo_succeeds_first_after_finish_after_kill_after_crash": 425,
    "test_group.py::test_colocated_group_kill_leaves_nothing_and_a_dead_node_crashes_the_group": 207,
    "test_speculative_sampling.py::test_speculative_sampling_matches_the_target_distribution": 135,
    "test_group.py::test_a_group_that_always_crashes_stops_after_max_and_a_kill_cancels_a_restart": 116,
    "test_group_export.py": 110,
    "test_kernels.py::test_transformers_fallback_notice_is_not_printed_for_a_cpu_target": 100,
    "test_group_supervisor.py::test_a_second_supervisor_is_refused_and_starts_nothing": 95,
    "test_compile_scope.py::test_regional_inductor_run_saves_artifacts_its_resume_loads_and_hits": 84,
}

TERMINAL_ENV = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, on the controller: hand each worker the terminal size variables of the run that started it."""
    node.workerinput["dflash_terminal_env"] = {k: os.environ.get(k) for k in TERMINAL_ENV}


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker starts with COLUMNS=80 and LINES=24 in its environment (its stdout is no terminal), which
    every child inherits: `opsctl watch` in a 160x50 tmux pane then drew an 80x24 screen (shutil and rich read the
    variables before the pane's size), so test_tui's tmux tests failed under xdist only. Put back the run's own."""
    terminal = getattr(config, "workerinput", {}).get("dflash_terminal_env")
    for name, value in (terminal or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _file(item: pytest.Item) -> str:
    return item.path.name


def _test(item: pytest.Item) -> str:
    """FILE::FUNCTION (every parametrization alike), as SLOW_TESTS and HEAVY name tests."""
    return f"{_file(item)}::{item.nodeid.split('::', 1)[-1].split('[')[0]}"


def _weight(item: pytest.Item) -> int:
    return HEAVY.get(_file(item), 0) if _file(item) in SHARED_FIXTURE_FILES else HEAVY.get(_test(item), 0)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the groups marked here into scheduling units
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _test(item) in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if WORKER is not None and _file(item) in SHARED_FIXTURE_FILES:
            item.add_marker(pytest.mark.xdist_group(_file(item)))
    if WORKER is not None:
        # Every worker collects and sorts alike (xdist checks that the collections match), and the scheduler hands out
        # work in this order (--no-loadscope-reorder): the slow tests first, then the grouped files and those that
        # launch the tiny default (by then its prebuild is on its way), then the rest; the HEAVY ones first in each
        # (a grouped file's unit sits where its first test does), the others in file order (the sort is stable, so
        # the tests of one file keep theirs: test_peer_bench.py's last test must stay last). A HEAVY grouped file
        # keeps its own order whole: its module fixture is then built in its first test's setup, not inside the
        # timeout of a slow test sorted ahead (test_warm_start's host-copy test ran past 600 s that way, under load).
        def cost(item: pytest.Item) -> tuple[int, int]:
            tiny = _file(item) in TINY_DEFAULT_FILES
            heavy_group = _file(item) in SHARED_FIXTURE_FILES and _weight(item) > 0
            if (item.get_closest_marker("slow") is not None or heavy_group) and not tiny:
                return 0, -_weight(item)
            return (1 if tiny or _file(item) in SHARED_FIXTURE_FILES else 2), -_weight(item)

        items.sort(key=cost)


_prebuild: subprocess.Popen[bytes] | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building configs/tiny.yaml's target and records in the background when a selected test needs them.

    Why: built inside the first test that needs them, they were minutes of that test's time and timeout, and every
    other worker's tiny test queued behind it. Started here (by one process: the plain session or worker gw0) they
    build while the other tests run; a test that gets there first waits on the cache entry's lock and reuses them.
    """
    global _prebuild
    if WORKER not in (None, "gw0") or session.config.option.collectonly:
        return
    if not any(_file(i) in TINY_DEFAULT_FILES for i in session.items):
        return
    log = session.config._tmp_path_factory.getbasetemp() / "tiny-default-prebuild.log"  # type: ignore[attr-defined]
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from agentlib import build_tiny_default; "
            "build_tiny_default()")
    with open(log, "wb") as fh:
        _prebuild = subprocess.Popen([sys.executable, "-c", code, str(TESTS / "runs")], stdin=subprocess.DEVNULL,
                                     stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A prebuild still running when the session ends (a -x stop, a deselected tiny test) is stopped by its PID:
    its cache entry stays unfinished and the next use rebuilds it (dflash/pretrain.py resolve_target)."""
    global _prebuild
    if _prebuild is not None and _prebuild.poll() is None:
        os.killpg(_prebuild.pid, signal.SIGTERM)
        try:
            _prebuild.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(_prebuild.pid, signal.SIGKILL)
            _prebuild.wait()
    _prebuild = None


@pytest.fixture(scope="session")
def pct_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PctHost]:
    """The `pct` stand-in (bin dir + state root); every container still running is stopped at session end."""
    host = make_pct_host(tmp_path_factory.mktemp("pct"))
    yield host
    host.stop_all()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory, pct_host: PctHost) -> Iterator[Sshd]:
    """A real sshd (own host + client keys, known_hosts pre-filled) whose sessions find the same `pct`."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"), pct_host=pct_host)
    yield server
    server.stop()


@pytest.fixture
def drop_ssh(sshd: Sshd) -> Callable[[], int]:
    """Call it to kill every live SSH connection to the test sshd (by PID, as a network drop); returns how many."""
    return sshd.drop_connections


@pytest.fixture
def container(pct_host: PctHost) -> Iterator[Callable[..., int]]:
    """`container(200)` creates and starts CT 200 (`start=False`: created, stopped); stopped again afterwards."""
    made: list[int] = []

    def make(vmid: int = 200, start: bool = True) -> int:
        pct_host.create(vmid, start=start)
        made.append(vmid)
        return vmid

    yield make
    for vmid in made:
        if pct_host.pct("status", str(vmid), check=False).stdout.strip() == "status: running":
            pct_host.pct("stop", str(vmid), check=False)
