"""A real OpenSSH sshd on 127.0.0.1 with its own keys, plus Proxmox `pct` stand-in containers, for transport tests.

Used by tests/conftest.py; kept importable on its own so benchmarks (bench/) can start the same server.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HARNESS_DIR = Path(__file__).resolve().parent
PCT_SCRIPT = HARNESS_DIR / "pct"
SSHD_BIN = "/usr/sbin/sshd"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ppid_and_comm(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1: stat.rindex(")")]
    return int(stat[stat.rindex(")") + 2:].split()[1]), comm


def descendants(root_pid: int) -> list[int]:
    """Every live process below `root_pid` (found through /proc parent links; never by name)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            info = _ppid_and_comm(int(d))
            if info:
                children.setdefault(info[0], []).append(int(d))
    out: list[int] = []
    todo = [root_pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


@dataclass
class PctHost:
    """The state of the `pct` stand-in: which containers exist and run. Shared by local and SSH sessions."""

    root: Path
    bin_dir: Path
    owner_pid: int = field(default_factory=os.getpid)  # containers end when this process ends

    def env(self) -> dict[str, str]:
        """Environment for a LocalTransport that should find `pct` like a Proxmox host's shell does."""
        return {"PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}", "PCT_STANDIN_ROOT": str(self.root),
                "PCT_STANDIN_OWNER_PID": str(self.owner_pid)}

    def pct(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env()}
        r = subprocess.run([str(self.bin_dir / "pct"), *args], env=env, capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"pct {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def create(self, vmid: int, start: bool = True) -> int:
        if not (self.root / "lxc" / f"{vmid}.conf").exists():
            self.pct("create", str(vmid), "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst")
        if start and self.pct("status", str(vmid)).stdout.strip() != "status: running":
            self.pct("start", str(vmid))
        return vmid

    def init_pid(self, vmid: int) -> int | None:
        """Host PID of the container's PID 1, or None when it is stopped."""
        try:
            return int((self.root / "run" / f"{vmid}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop_all(self) -> None:
        lxc = self.root / "lxc"
        for conf in sorted(lxc.glob("*.conf")) if lxc.is_dir() else []:
            vmid = conf.stem
            if self.pct("status", vmid, check=False).stdout.strip() == "status: running":
                self.pct("stop", vmid, check=False)


@dataclass
class Sshd:
    """A running sshd. `ssh_settings()` / `host_entry()` / `write_hosts_yaml()` build client config for it."""

    dir: Path
    port: int
    user: str
    identity_file: str
    known_hosts: str
    host_pub_line: str
    pct_host: PctHost
    session_path: str
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def ssh_settings(self, **over: Any) -> Any:
        from opsctl.config import SSHSettings

        base: dict[str, Any] = dict(host=self.host, port=self.port, user=self.user, identity_file=self.identity_file,
                                    known_hosts=self.known_hosts, use_ssh_config=False, connect_timeout=10)
        base.update(over)
        return SSHSettings(**base)

    def host_entry(self, pct: int | None = None, **ssh_over: Any) -> dict[str, Any]:
        """A hosts.yaml `hosts.NAME` mapping for this server (optionally a pct container on it)."""
        ssh: dict[str, Any] = dict(host=self.host, port=self.port, user=self.user, identity_file=self.identity_file,
                                   known_hosts=self.known_hosts, use_ssh_config=False, connect_timeout=10)
        ssh.update(ssh_over)
        entry: dict[str, Any] = {"ssh": ssh, "python": sys.executable}
        if pct is not None:
            entry["pct"] = pct
        return entry

    def write_hosts_yaml(self, path: str | Path, runs: dict[str, dict[str, Any]] | None = None, name: str = "box",
                         pct: int | None = None, local_runs: dict[str, dict[str, Any]] | None = None,
                         **ssh_over: Any) -> Path:
        """Write a hosts.yaml with host `name` (this sshd, optionally pct) and `local` hosting `local_runs`."""
        entry = self.host_entry(pct=pct, **ssh_over)
        if runs:
            entry["runs"] = runs
        hosts: dict[str, Any] = {name: entry}
        if local_runs is not None:
            hosts["local"] = {"local": True, "runs": local_runs}
        p = Path(path)
        p.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=False))
        return p

    def connection_pids(self) -> list[int]:
        """PIDs of the per-connection sshd processes (children of the listener and their sshd children)."""
        out = []
        for pid in descendants(self.pid):
            info = _ppid_and_comm(pid)
            if info and info[1].startswith("sshd"):
                out.append(pid)
        return out

    def drop_connections(self) -> int:
        """Kill every per-connection sshd (SIGKILL by PID), as a network drop would end them; returns how many.

        The commands those sessions ran see EOF on stdin and a closed stdout, exactly as after a real drop.
        """
        targeted: set[int] = set()
        for _ in range(10):  # a connection accepted while we scan shows up in the next round
            pids = self.connection_pids()
            if not pids:
                break
            targeted.update(pids)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in pids:
                _wait_pid_gone(pid)
        return len(targeted)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.drop_connections()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _wait_pid_gone(pid: int, timeout: float = 10) -> None:
    import select

    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def _die_with_parent() -> None:
    # If pytest is killed outright, the listener gets SIGTERM from the kernel instead of living on.
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def keygen(path: Path, comment: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True,
                   stdin=subprocess.DEVNULL, capture_output=True)
    return (path.with_suffix(".pub") if path.suffix else Path(str(path) + ".pub")).read_text().strip()


def make_pct_host(base: Path) -> PctHost:
    """A `pct` stand-in installed as `<base>/bin/pct`, with its state under `<base>/pve`."""
    bin_dir = base / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(PCT_SCRIPT, bin_dir / "pct")
    (bin_dir / "pct").chmod(0o755)
    root = base / "pve"
    root.mkdir(exist_ok=True)
    return PctHost(root=root, bin_dir=bin_dir)


def start_sshd(base: Path, pct_host: PctHost | None = None, tries: int = 3, listen: str = "127.0.0.1") -> Sshd:
    """Start `sshd -D -e -f CONFIG` on LISTEN:<free port>; returns once it listens (read from its log).

    `listen` may be any loopback address (127.0.0.0/8): one machine then holds several "hosts", each its own sshd."""
    if not Path(SSHD_BIN).exists():
        raise RuntimeError(f"{SSHD_BIN} not found: install openssh-server (./dev does)")
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o700)
    pct_host = pct_host or make_pct_host(base / "pct")
    host_key = base / "host_ed25519"
    client_key = base / "client_ed25519"
    host_pub = keygen(host_key, "opsctl-test-host")
    client_pub = keygen(client_key, "opsctl-test-client")
    (base / "authorized_keys").write_text(client_pub + "\n")
    os.chmod(base / "authorized_keys", 0o600)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege-separation directory sshd insists on
    # The sessions' PATH: the pct stand-in first, then the interpreter running the tests (python3 = .venv's,
    # like a GPU box whose python3 has torch), then the usual system directories.
    session_path = ":".join([str(pct_host.bin_dir), str(Path(sys.executable).parent),
                             "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    # Sessions start from a fresh environment (sshd passes none of its own): the test process's OpenMP thread count
    # (tests/conftest.py sets OMP_NUM_THREADS=1 on xdist workers) is handed on too, or every trainer started over SSH
    # ran torch on a thread pool per core, which on a loaded box spins instead of working (a tiny target's decode
    # step: 20x slower on 2 busy cores, measured 2026-12-07).
    threads = os.environ.get("OMP_NUM_THREADS", "")
    session_env = f" OMP_NUM_THREADS={threads}" if threads.isdigit() else ""
    user = getpass.getuser()
    last_err = ""
    for _ in range(tries):
        port = _free_port(listen)
        cfg = base / "sshd_config"
        cfg.write_text("\n".join([
            f"Port {port}",
            f"ListenAddress {listen}",
            f"HostKey {host_key}",
            f"PidFile {base / 'sshd.pid'}",
            f"AuthorizedKeysFile {base / 'authorized_keys'}",
            "UsePAM no",
            "StrictModes no",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "PermitRootLogin yes",
            "MaxStartups 64:30:128",
            "MaxSessions 64",
            "LogLevel INFO",
            "PrintMotd no",
            "UseDNS no",
            f"SetEnv PATH={session_path} PCT_STANDIN_ROOT={pct_host.root} PCT_STANDIN_OWNER_PID={pct_host.owner_pid}"
            f"{session_env}",
            "",
        ]))
        log_path = base / "sshd.log"
        proc = subprocess.Popen([SSHD_BIN, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_die_with_parent)
        assert proc.stderr is not None
        ready = threading.Event()
        lines: list[str] = []
        log = open(log_path, "a", buffering=1)  # noqa: SIM115 - closed by the drain thread at EOF

        def drain(stream: Any = proc.stderr, log: Any = log, ready: threading.Event = ready,
                  lines: list[str] = lines) -> None:
            for raw in iter(stream.readline, b""):
                text = raw.decode(errors="replace")
                log.write(text)
                lines.append(text)
                if "Server listening on" in text:
                    ready.set()
            log.close()
            ready.set()  # EOF: sshd exited; the caller sees proc.poll() != None

        threading.Thread(target=drain, daemon=True).start()
        ready.wait(20)
        if proc.poll() is None and any("Server listening on" in x for x in lines):
            kh = base / "known_hosts"
            kh.write_text(f"[{listen}]:{port} {' '.join(host_pub.split()[:2])}\n")
            return Sshd(dir=base, port=port, user=user, identity_file=str(client_key), known_hosts=str(kh),
                        host_pub_line=host_pub, pct_host=pct_host, session_path=session_path, host=listen,
                        proc=proc, log_path=log_path)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        last_err = "".join(lines)
    raise RuntimeError(f"sshd did not start: {last_err.strip()}")
