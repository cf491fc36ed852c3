"""The test harness itself: the real sshd accepts exactly our key, and the `pct` stand-in fails and isolates like pct.

If these fail, every SSH/pct test above them means nothing, so they check the harness against the real tools.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from harness.sshd import PctHost, Sshd, descendants, keygen

from opsctl.transport import LocalTransport, PctTransport, SSHTransport, TransportError


def ssh_cli(sshd: Sshd, key: str, *cmd: str, known_hosts: str | None = None) -> subprocess.CompletedProcess[str]:
    """The OpenSSH client, so the harness is checked with the real thing, not only with our own transport."""
    return subprocess.run(
        ["ssh", "-F", "/dev/null", "-i", key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
         "-o", f"UserKnownHostsFile={known_hosts or sshd.known_hosts}", "-o", "StrictHostKeyChecking=yes",
         "-o", "ConnectTimeout=10", "-p", str(sshd.port), f"{sshd.user}@127.0.0.1", "--", *cmd],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_sshd_accepts_the_client_key_and_sets_the_session_path(sshd: Sshd) -> None:
    r = ssh_cli(sshd, sshd.identity_file, "echo", "$PCT_STANDIN_ROOT", "&&", "command", "-v", "pct", "&&",
                "echo", "${OMP_NUM_THREADS-unset}")
    assert r.returncode == 0, r.stderr
    root, pct, threads = r.stdout.split()
    assert root == str(sshd.pct_host.root)
    assert pct == str(sshd.pct_host.bin_dir / "pct")
    # the test process's OpenMP thread count (1 on xdist workers, tests/conftest.py) reaches trainers started over SSH
    assert threads == os.environ.get("OMP_NUM_THREADS", "unset")


def test_sshd_refuses_an_unknown_client_key(sshd: Sshd, tmp_path: Path) -> None:
    keygen(tmp_path / "stranger", "stranger")
    r = ssh_cli(sshd, str(tmp_path / "stranger"), "true")
    assert r.returncode == 255
    assert "Permission denied (publickey)" in r.stderr
    with pytest.raises(TransportError, match="authentication failed"):
        SSHTransport(sshd.ssh_settings(identity_file=str(tmp_path / "stranger"))).run(["true"])


def test_known_hosts_holds_the_real_host_key(sshd: Sshd, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    r = ssh_cli(sshd, sshd.identity_file, "true", known_hosts=str(empty))
    assert r.returncode == 255 and "Host key verification failed" in r.stderr
    assert ssh_cli(sshd, sshd.identity_file, "true").returncode == 0


def test_drop_connections_kills_only_this_servers_sessions(sshd: Sshd) -> None:
    t = SSHTransport(sshd.ssh_settings())
    try:
        assert t.run(["true"]).rc == 0
        before = sshd.connection_pids()
        assert before and all(p in descendants(sshd.pid) for p in before)
        assert sshd.drop_connections() >= len(before)
        assert sshd.connection_pids() == []
        assert sshd.proc is not None and sshd.proc.poll() is None  # the listener survives
        assert t.run(["echo", "again"]).stdout == b"again\n"  # and takes new connections
    finally:
        t.close()


# ------------------------------------------------------------------------------------------------------------
# pct stand-in: parsing and errors (texts from pve-container's pct.pm / PVE::CLIHandler, exit 255 as perl's die)


def proc_file(pid: int, name: str) -> bytes:
    """/proc/PID/NAME, or b"" when the process ended in between (it may, while we scan)."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def nspid(pid: int) -> list[int]:
    """A process's PID in each nested PID namespace, outermost first (NSpid in /proc/PID/status)."""
    for line in proc_file(pid, "status").decode().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return []


def pct(host: PctHost, *args: str) -> subprocess.CompletedProcess[str]:
    return host.pct(*args, check=False)


def test_pct_errors_match_proxmox(pct_host: PctHost, container: object) -> None:
    node = os.uname().nodename.split(".")[0]
    pct_host.create(210, start=False)
    cases = [
        (("exec", "299", "--", "true"), f"Configuration file 'nodes/{node}/lxc/299.conf' does not exist\n"),
        (("status", "299"), f"Configuration file 'nodes/{node}/lxc/299.conf' does not exist\n"),
        (("exec", "210", "--", "true"), "container '210' not running!\n"),
        (("exec", "abc", "--", "true"),
         "400 Parameter verification failed.\nvmid: type check ('integer') failed - got 'abc'\n"
         "pct exec <vmid> [<extra-args>] [OPTIONS]\n"),
        (("exec", "99", "--", "true"),
         "400 Parameter verification failed.\nvmid: value must have a minimum value of 100\n"
         "pct exec <vmid> [<extra-args>] [OPTIONS]\n"),
        (("exec",), "400 not enough arguments\npct exec <vmid> [<extra-args>] [OPTIONS]\n"),
        (("stop", "210"), "CT 210 not running\n"),
        (("start", "210", "extra"), "400 too many arguments\npct start <vmid> [OPTIONS]\n"),
    ]
    for args, stderr in cases:
        r = pct(pct_host, *args)
        assert (r.returncode, r.stderr, r.stdout) == (255, stderr, ""), args
    r = pct(pct_host, "frobnicate")
    assert r.returncode == 255 and r.stderr.startswith("ERROR: unknown command 'pct frobnicate'\nUSAGE: pct <COMMAND>")
    assert pct(pct_host, "status", "210").stdout == "status: stopped\n"


def test_pct_exec_argument_handling(pct_host: PctHost, container: object) -> None:
    container(211)  # type: ignore[operator]
    r = pct(pct_host, "exec", "211")
    assert r.returncode == 255 and r.stderr.startswith("missing command at ")
    # without `--`, an argument that looks like an option is pct's, and unknown -> refused (use `--`!)
    r = pct(pct_host, "exec", "211", "ls", "-la")
    assert r.returncode == 255 and r.stderr.startswith("Unknown option: la\n400 unable to parse option\n")
    assert pct(pct_host, "exec", "211", "echo", "plain").stdout == "plain\n"
    r = pct(pct_host, "exec", "211", "--", "sh", "-c", 'echo "$0|$1"; exit 3', "-x", "a b")
    assert (r.returncode, r.stdout) == (3, "-x|a b\n")
    r = pct(pct_host, "start", "211")
    assert (r.returncode, r.stderr) == (255, "CT 211 already running\n")
    # PVE 8 keeps the caller's environment by default; --keep-env 0 is lxc-attach --clear-env
    assert "PCT_STANDIN_ROOT=" in pct(pct_host, "exec", "211", "--", "env").stdout
    assert sorted(pct(pct_host, "exec", "211", "--keep-env", "0", "--", "env").stdout.split()) == [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "container=lxc"]
    assert pct(pct_host, "status", "211").stdout == "status: running\n"


def test_pct_container_has_its_own_pid_namespace_and_stop_kills_everything(pct_host: PctHost, container: object,
                                                                            tmp_path: Path) -> None:
    container(212)  # type: ignore[operator]
    t = PctTransport(LocalTransport(env=pct_host.env()), 212)
    inside = t.run(["sh", "-c", "readlink /proc/self/ns/pid; echo $$"]).stdout.decode().split()
    assert inside[0] != os.readlink("/proc/self/ns/pid")
    assert int(inside[1]) < 50  # the container sees its own, small PIDs
    # a daemonized process outlives the exec session, inside the container; it reports its container PID
    # through a FIFO (a blocking read, no polling)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = t.run(["sh", "-c", 'setsid sh -c \'echo $$ > "$0"; exec sleep 300\' "$0" </dev/null >/dev/null 2>&1 &', str(fifo)])
    assert r.rc == 0, r.stderr
    ct_pid = int(fifo.read_text())
    init = pct_host.init_pid(212)
    assert init is not None
    sleepers = [p for p in descendants(init) if nspid(p)[-1:] == [ct_pid]]
    assert len(sleepers) == 1 and nspid(sleepers[0])[0] == sleepers[0] != ct_pid
    assert pct_host.pct("stop", "212").returncode == 0
    assert not Path(f"/proc/{sleepers[0]}").exists() and not Path(f"/proc/{init}").exists()
    assert pct(pct_host, "status", "212").stdout == "status: stopped\n"


def test_tmux_inside_a_container_lives_in_the_container(pct_host: PctHost, container: object, tmp_path: Path) -> None:
    container(213)  # type: ignore[operator]
    t = PctTransport(LocalTransport(env=pct_host.env()), 213)
    r = t.run(["tmux", "new-session", "-d", "-s", "ct-test", "sleep 300"])
    assert r.rc == 0, r.stderr
    r = t.run(["tmux", "list-panes", "-t", "ct-test", "-F", "#{pane_pid}"])
    assert r.rc == 0, r.stderr
    inner_pid = int(r.stdout)  # as the container sees it
    init = pct_host.init_pid(213)
    assert init is not None
    servers = [p for p in descendants(init) if proc_file(p, "comm").strip() == b"tmux: server"]
    assert len(servers) == 1
    assert os.readlink(f"/proc/{servers[0]}/ns/pid") == os.readlink(f"/proc/{init}/ns/pid")
    assert inner_pid < 50
    pct_host.pct("stop", "213")
    assert not Path(f"/proc/{servers[0]}").exists()


def test_stale_pid_file_counts_as_stopped(pct_host: PctHost, container: object) -> None:
    container(214, start=False)  # type: ignore[operator]
    run = pct_host.root / "run"
    run.mkdir(exist_ok=True)
    (run / "214.pid").write_text(f"{os.getpid()} 1 {os.getpid()}\n")  # a live pid with the wrong start time
    assert pct(pct_host, "status", "214").stdout == "status: stopped\n"
    (run / "214.pid").unlink()


def test_pct_over_ssh_is_the_same_pct(sshd: Sshd, container: object) -> None:
    container(215)  # type: ignore[operator]
    t = SSHTransport(sshd.ssh_settings())
    try:
        assert PctTransport(t, 215).status() == "running"
        r = t.run(["pct", "exec", "216", "--", "true"])
        assert r.rc == 255 and r.stderr.endswith(b"lxc/216.conf' does not exist\n")
    finally:
        t.close()


def test_containers_end_when_their_owner_process_ends(pct_host: PctHost, tmp_path: Path) -> None:
    # a stand-in for a test session that dies without teardown: containers must not outlive it
    owner = subprocess.Popen(["sleep", "60"])
    try:
        env = {**os.environ, **pct_host.env(), "PCT_STANDIN_OWNER_PID": str(owner.pid)}
        pct_bin = str(pct_host.bin_dir / "pct")
        subprocess.run([pct_bin, "create", "217", "local:vztmpl/x.tar.zst"], env=env, check=True)
        subprocess.run([pct_bin, "start", "217"], env=env, check=True)
        init = pct_host.init_pid(217)
        assert init is not None and Path(f"/proc/{init}").exists()
        inner = subprocess.run([pct_bin, "exec", "217", "--", "sh", "-c",
                                "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo ok"], env=env,
                               capture_output=True, text=True)
        assert inner.stdout == "ok\n"
        pidfd = os.pidfd_open(init)
    finally:
        owner.kill()
        owner.wait()
    try:
        import select

        assert select.select([pidfd], [], [], 10)[0] == [pidfd]  # init ended on its own
    finally:
        os.close(pidfd)
    assert pct(pct_host, "status", "217").stdout == "status: stopped\n"
