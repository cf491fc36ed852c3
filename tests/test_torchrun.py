"""`python -m dflash.torchrun`: torchrun whose head node keeps the c10d store up until the other nodes have left.

Two real torchrun nodes on loopback (127.0.0.2 hosts the store, 127.0.0.3 joins). Node 1's agent is made slow to
close the rendezvous (a sitecustomize delays DynamicRendezvousHandler.shutdown), which is the race CI hit: with
plain torchrun the head leaves first and node 1's successful log ends with "failed to shutdown the rendezvous".
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from dflash import torchrun as launcher

REPO = Path(__file__).resolve().parent.parent
SHUTDOWN_DELAY_S = 4.0

_SLOW_CLOSE = f"""
import os
if "LOCAL_RANK" not in os.environ:  # the agent, not its workers
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _d
    import time as _t
    _shutdown = _d.DynamicRendezvousHandler.shutdown
    def _slow(self):
        _t.sleep({SHUTDOWN_DELAY_S})
        return _shutdown(self)
    _d.DynamicRendezvousHandler.shutdown = _slow
"""
_WORKER = "import os\nprint('worker', os.environ['RANK'], 'done', flush=True)\n"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _argv(node: int, port: int, run_id: str) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--local-addr", f"127.0.0.{2 + node}",
            "--max-restarts", "0"]


@pytest.mark.parametrize("module", ["torch.distributed.run", "dflash.torchrun"])
def test_a_node_slow_to_close_the_rendezvous_still_closes_it_cleanly_only_with_dflash_torchrun(
        tmp_path: Path, module: str) -> None:
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(_SLOW_CLOSE)
    (tmp_path / "worker.py").write_text(_WORKER)
    port = _free_port("127.0.0.2")
    procs = []
    for node in (0, 1):
        path = f"{slow}:{REPO}" if node == 1 else str(REPO)
        env = {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        log = tmp_path / f"node{node}.log"
        with log.open("w") as fh:
            argv = [sys.executable, "-m", module, *_argv(node, port, "rt"), str(tmp_path / "worker.py")]
            procs.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    ended: list[float] = []
    try:
        for p in procs:
            p.wait(timeout=120)
            ended.append(time.monotonic())
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # the node's own session (start_new_session): its agent and workers
                p.wait()
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "worker 0 done" in logs[0] and "worker 1 done" in logs[1]
    failed = "failed to shutdown the rendezvous" in logs[1]
    # The control shows that the delay reproduces the race with plain torchrun; dflash.torchrun removes it.
    assert failed == (module == "torch.distributed.run"), logs[1][-3000:]
    assert "RendezvousConnectionError" not in logs[1] or module == "torch.distributed.run"
    assert "did not say they left" not in logs[0]


def test_the_arguments_decide_whether_there_is_a_store_to_keep_up() -> None:
    head = launcher.rendezvous([*_argv(0, 29400, "g-r"), "w.py"])
    assert head == launcher.Rendezvous("127.0.0.2", 29400, "g-r", 1, True)
    other = launcher.rendezvous([*_argv(1, 29400, "g-r"), "w.py"])
    assert other is not None and not other.is_host and other.left_key == head.left_key
    assert launcher.rendezvous(["--standalone", "--nproc-per-node", "2", "w.py"]) is None
    # Who hosts is left to torchrun's hostname guess: nothing here can tell, so plain torchrun.
    assert launcher.rendezvous(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "w.py"]) is None
    one = _argv(0, 29400, "x")
    one[1] = "1"
    assert launcher.rendezvous([*one, "w.py"]) is None
    elastic = _argv(0, 29400, "x")
    elastic[1] = "2:4"
    got = launcher.rendezvous([*elastic, "w.py"])
    assert got is not None and got.others == 3


def test_the_head_waits_for_the_others_but_not_past_its_linger(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port("127.0.0.2")
    rdzv = launcher.Rendezvous("127.0.0.2", port, "w", 2, True)
    store = launcher.host_store(rdzv)
    assert store is not None
    assert launcher.say_left(rdzv)
    t0 = time.monotonic()
    assert launcher.wait_for_others(store, rdzv, linger_s=0.5) == 1
    assert 0.5 <= time.monotonic() - t0 < 5
    assert "1 of 2 other nodes did not say they left within 0.5 s" in capsys.readouterr().err
    assert launcher.say_left(rdzv)
    t0 = time.monotonic()
    assert launcher.wait_for_others(store, rdzv, linger_s=30) == 2 and time.monotonic() - t0 < 1
    # The agent's own store (same host, port, multi_tenant) shares this server rather than failing to bind.
    agent = TCPStore("127.0.0.2", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=5))
    assert agent.add(rdzv.left_key, 0) == 2
    # No head listening (it crashed or was killed): the node gives up after its connect tries, it does not hang.
    gone = launcher.Rendezvous("127.0.0.2", _free_port("127.0.0.2"), "w", 1, False)
    t0 = time.monotonic()
    assert not launcher.say_left(gone) and time.monotonic() - t0 < 4 * launcher.SAY_LEFT_TIMEOUT_S + 10


def _standalone(tmp_path: Path, *worker: str) -> tuple[int, str]:
    """A real single-node dflash.torchrun of two ranks; (exit code, its log)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"):
        env.pop(k, None)
    cp = subprocess.run([sys.executable, "-m", "dflash.torchrun", "--standalone", "--nproc-per-node", "2",
                         "--max-restarts", "0", *worker], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=180)
    return cp.returncode, cp.stdout + cp.stderr


def test_a_rank_refused_with_a_dflash_error_line_makes_torchrun_exit_with_its_code_and_line(tmp_path: Path) -> None:
    from opsctl.remote.rules import crash_line, torchrun_root_cause

    missing = tmp_path / "missing.yaml"
    rc, log = _standalone(tmp_path, "-m", "dflash", "train", "--config", str(missing), "--out", str(tmp_path / "o"))
    line = f"dflash: {missing}: cannot read config"
    assert rc == 2, log[-3000:]  # the rank's own usage exit code, not torchrun's generic 1
    assert "ChildFailedError" in log and f"traceback : {line}" in log, log[-3000:]  # torchrun's report carries it
    last = log.rstrip().splitlines()[-1]
    assert last.startswith("dflash.torchrun: rank ") and f"failed first, exit code 2: {line}" in last, last
    (tmp_path / "run.log").write_text(log)
    cause = torchrun_root_cause(log.splitlines())  # what opsctl shows for a torchrun node (status, group verdict)
    assert cause is not None and cause.startswith("rank ") and line in cause, cause
    assert (crash_line(str(tmp_path / "run.log")) or "").startswith(line)


def test_a_rank_killed_by_a_signal_makes_torchrun_exit_128_plus_the_signal(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text("import os, signal, time\nif os.environ['RANK'] == '1':\n"
                                   "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(30)\n")
    rc, log = _standalone(tmp_path, "w.py")
    assert rc == 128 + 9, log[-3000:]
    assert log.rstrip().splitlines()[-1].startswith("dflash.torchrun: rank 1 failed first, exit code 137: Signal 9"), \
        log[-2000:]
