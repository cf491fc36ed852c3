"""Transports over local, real SSH and SSH + pct: byte-exact argv, streams, host-key policy, errors a user can act on.

Hostile values (quotes, $(), backticks, ;, newlines, globs) must arrive as data on every layer and run nothing.
"""

from __future__ import annotations

import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness.sshd import PctHost, Sshd

import opsctl.transport as transport_mod
from opsctl.config import HostConfig, SSHSettings, load_inventory, parse_inventory, resolve
from opsctl.transport import (
    LocalTransport,
    PctTransport,
    PermanentTransportError,
    PreflightRefused,
    SSHTransport,
    Transport,
    TransportError,
    TransportTimeout,
    shell_join,
    transport_for,
)

VMID = 230


def hostile(canary: Path) -> list[str]:
    """Values that would run `touch CANARY` if any layer parsed them as shell code."""
    c = shlex.quote(str(canary))
    return [
        "plain", "with space", "it's", 'say "hi"', f"$(touch {c})", f"`touch {c}`", f"; touch {c}", f"a && touch {c}",
        f"x\ntouch {c}", "*", "/*", "~", "$HOME", "${PATH}", "\\", "\\n", "'", '"', "", " lead", "trail ", "-n",
        "--", "a|b", "a>b", "#hash", "%s%n", "ünïcödé ✓", "\t tab", "!bang", "{a,b}", "$((1+1))",
    ]


@pytest.fixture(scope="module")
def ssh(sshd: Sshd) -> Iterator[SSHTransport]:
    t = SSHTransport(sshd.ssh_settings())
    yield t
    t.close()


@pytest.fixture(scope="module")
def ct(pct_host: PctHost) -> Iterator[int]:
    pct_host.create(VMID)
    yield VMID
    pct_host.pct("stop", str(VMID), check=False)


@pytest.fixture(params=["local", "ssh", "ssh+pct", "local+pct"])
def transport(request: pytest.FixtureRequest) -> Transport:
    kind = request.param
    if kind == "local":
        return LocalTransport()
    if kind == "local+pct":
        request.getfixturevalue("ct")
        return PctTransport(LocalTransport(env=request.getfixturevalue("pct_host").env()), VMID)
    ssh = request.getfixturevalue("ssh")
    if kind == "ssh":
        return ssh
    request.getfixturevalue("ct")
    return PctTransport(ssh, VMID)


def test_shell_join_quotes_once_and_refuses_what_exec_cannot_pass() -> None:
    argv = ["echo", "a b", "$(x)", ""]
    assert shlex.split(shell_join(argv)) == argv
    for bad in ([], ["a\x00b"], "echo hi", [1]):
        with pytest.raises(ValueError):
            shell_join(bad)  # type: ignore[arg-type]


def test_argv_for_shows_each_layer_quoted_once(ssh: SSHTransport) -> None:
    argv = ["printf", "%s", "$(id)"]
    assert LocalTransport().argv_for(argv) == argv
    assert ssh.argv_for(argv) == "printf %s '$(id)'"
    over_ssh = PctTransport(ssh, 200).argv_for(argv)
    assert isinstance(over_ssh, str) and shlex.split(over_ssh) == ["pct", "exec", "200", "--", *argv]
    assert PctTransport(LocalTransport(), 200).argv_for(["-x"]) == ["pct", "exec", "200", "--", "-x"]


def test_hostile_values_arrive_byte_exact_and_run_nothing(transport: Transport, tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    vals = hostile(canary)
    r = transport.run(["printf", "%s\\0", *vals])
    assert r.rc == 0, r.stderr
    assert r.stdout.split(b"\0")[:-1] == [v.encode() for v in vals]
    # as paths (workdir, log path) and as environment values (env NAME=VALUE passes argv too)
    d = tmp_path / "dir $(touch x) ; `y` 'q'\n*"
    assert transport.run(["mkdir", "-p", str(d)]).rc == 0
    assert d.is_dir()
    r = transport.run(["env", f"WEIRD={vals[4]}\n{vals[5]}", "sh", "-c", 'printf %s "$WEIRD"'])
    assert r.stdout == f"{vals[4]}\n{vals[5]}".encode()
    assert not canary.exists()


def test_hostile_tmux_session_name_over_ssh_and_pct(ssh: SSHTransport, ct: int, tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    name = f"dflash $(touch {canary}) `x` ;y 'q' \"d\""
    t = PctTransport(ssh, ct)
    sock = str(tmp_path / "tmux sock")
    r = t.run(["tmux", "-S", sock, "new-session", "-d", "-s", name, "sleep 60"])
    assert r.rc == 0, r.stderr
    try:
        r = t.run(["tmux", "-S", sock, "list-sessions", "-F", "#{session_name}"])
        assert r.stdout.decode().splitlines() == [name]
    finally:
        t.run(["tmux", "-S", sock, "kill-server"])
    assert not canary.exists()


def test_run_returns_rc_and_separate_bytes(transport: Transport) -> None:
    data = bytes(range(256)) * 64
    r = transport.run(["sh", "-c", "cat; echo err >&2; exit 7"], input=data)
    assert (r.rc, r.stdout, r.stderr) == (7, data, b"err\n")
    rc, out, err = transport.run(["true"])
    assert (rc, out, err) == (0, b"", b"")


def test_run_returns_when_the_command_exits_even_if_a_background_child_holds_stdout(
        transport: Transport, monkeypatch: pytest.MonkeyPatch) -> None:
    # `nohup x &` over ssh used to hang the client until the child exited (PAIN.md's 30 s tool time-out)
    monkeypatch.setattr(transport_mod, "EXIT_GRACE_S", 0.5)
    t0 = time.monotonic()
    r = transport.run(["sh", "-c", "sleep 6 & echo started; echo err >&2; exit 4"], timeout=30)
    assert time.monotonic() - t0 < 4
    assert (r.rc, r.stdout, r.stderr) == (4, b"started\n", b"err\n")


def test_missing_command_is_rc_127_everywhere(transport: Transport) -> None:
    r = transport.run(["no-such-command-xyz"])
    assert r.rc == 127
    assert b"no-such-command-xyz" in r.stderr


def test_run_timeout_raises_and_kills(transport: Transport) -> None:
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="timed out after 0.5s"):
        transport.run(["sleep", "8"], timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_stream_delivers_lines_live_and_close_means_eof(transport: Transport, tmp_path: Path) -> None:
    marker = tmp_path / "saw-eof"
    script = ("import sys\n"
              "for line in sys.stdin:\n"
              "    sys.stdout.write('echo:' + line); sys.stdout.flush()\n"
              f"open({str(marker)!r}, 'w').write('eof')\n")
    s = transport.stream(["python3", "-u", "-c", script], b"first\n")
    assert next(s.stdout) == b"echo:first\n"  # arrives while the process is still running
    s.write(b"second\n")
    assert next(s.stdout) == b"echo:second\n"
    s.close()
    assert list(s.stdout) == []
    assert s.wait(10) == 0
    assert marker.read_text() == "eof"


def test_stream_kill_and_stderr(transport: Transport) -> None:
    # `cat` ends on EOF, which is all an SSH channel close can promise (local kill SIGKILLs the process group)
    s = transport.stream(["sh", "-c", "echo ready; exec cat >/dev/null"])
    assert next(s.stdout) == b"ready\n"
    s.kill()
    with pytest.raises(StopIteration):
        next(s.stdout)
    # stderr is drained on its own (a chatty stderr can never block stdout) and complete once wait() returns
    s = transport.stream(["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' e >&2; echo done"])
    assert list(s.stdout) == [b"done\n"]
    assert s.wait(10) == 0
    assert s.stderr == b"e" * 300000


def test_ssh_drop_ends_the_stream_and_the_next_call_reconnects(sshd: Sshd, drop_ssh: Callable[[], int]) -> None:
    t = SSHTransport(sshd.ssh_settings())
    try:
        s = t.stream(["cat"], b"hello\n")
        assert next(s.stdout) == b"hello\n"
        assert drop_ssh() >= 1
        assert list(s.stdout) == []
        with pytest.raises(TransportError, match="connection lost"):
            s.wait(10)
        assert t.run(["echo", "back"]).stdout == b"back\n"
        assert t.is_connected
        for i in range(3):  # a command right after a drop gets a fresh connection, never a dead one
            drop_ssh()
            assert t.run(["echo", str(i)]).stdout == f"{i}\n".encode()
    finally:
        t.close()


def test_unknown_host_key_is_refused_without_the_flag(sshd: Sshd, tmp_path: Path) -> None:
    kh = tmp_path / "kh" / "known_hosts"
    with pytest.raises(TransportError, match="not in known_hosts.*--accept-new-host-key"):
        SSHTransport(sshd.ssh_settings(known_hosts=str(kh))).run(["true"])
    assert not kh.exists()
    t = SSHTransport(sshd.ssh_settings(known_hosts=str(kh)), accept_new_host_key=True)
    assert t.run(["echo", "ok"]).stdout == b"ok\n"
    t.close()
    saved = kh.read_text().split()
    assert saved[0] == f"[127.0.0.1]:{sshd.port}" and saved[1:3] == sshd.host_pub_line.split()[:2]
    t = SSHTransport(sshd.ssh_settings(known_hosts=str(kh)))  # now known: no flag needed
    assert t.run(["true"]).rc == 0
    t.close()
    # accepting appends one line and leaves everything else in the user's file alone
    import paramiko

    ca = paramiko.Ed25519Key.from_private_key_file(sshd.identity_file)
    keep = f"# my hosts\n@cert-authority *.corp {ca.get_name()} {ca.get_base64()}\nother.example ssh-ed25519 {ca.get_base64()}\n"
    kh.write_text(keep)
    t = SSHTransport(sshd.ssh_settings(known_hosts=str(kh)), accept_new_host_key=True)
    assert t.run(["true"]).rc == 0
    t.close()
    text = kh.read_text()
    assert text.startswith(keep) and text[len(keep):].split()[:2] == [f"[127.0.0.1]:{sshd.port}", "ssh-ed25519"]


def test_changed_host_key_is_refused_even_with_the_flag(sshd: Sshd, tmp_path: Path) -> None:
    import paramiko

    other = paramiko.Ed25519Key.from_private_key_file(sshd.identity_file)  # any key that is not the host's
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{sshd.port} {other.get_name()} {other.get_base64()}\n")
    with pytest.raises(TransportError, match="HOST KEY MISMATCH.*ssh-keygen -R"):
        SSHTransport(sshd.ssh_settings(known_hosts=str(kh)), accept_new_host_key=True).run(["true"])


def test_unreachable_and_silent_servers_fail_fast_with_a_reason() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportError, match="unreachable"):
        SSHTransport(SSHSettings(host="127.0.0.1", port=port, use_ssh_config=False)).run(["true"])
    # a server that accepts TCP and never speaks: the connect timeout must bound the wait
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    conns: list[socket.socket] = []
    threading.Thread(target=lambda: conns.append(srv.accept()[0]), daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TransportError):
            SSHTransport(SSHSettings(host="127.0.0.1", port=srv.getsockname()[1], connect_timeout=1,
                                     use_ssh_config=False)).run(["true"])
        assert time.monotonic() - t0 < 5
    finally:
        srv.close()
        for c in conns:
            c.close()


def test_a_connection_closed_mid_handshake_is_a_transport_error_a_reconnect_loop_retries() -> None:
    """A server that sends its banner and then closes (sshd restarting, a link dropping during key exchange): paramiko
    raises a bare EOFError there, which escaped the reconnect loops (they retry TransportError) as a traceback."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    conns: list[socket.socket] = []

    def serve() -> None:
        c = srv.accept()[0]
        conns.append(c)
        c.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        c.recv(4096)
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(TransportError, match="closed during the SSH handshake") as exc:
            SSHTransport(SSHSettings(host="127.0.0.1", port=srv.getsockname()[1], connect_timeout=5,
                                     use_ssh_config=False)).run(["true"])
        assert not isinstance(exc.value, PermanentTransportError)
    finally:
        srv.close()


def test_keepalive_is_set_on_the_connection(sshd: Sshd) -> None:
    t = SSHTransport(sshd.ssh_settings(keepalive_s=7))
    try:
        t.connect()
        packetizer = t._conn.transport.packetizer  # type: ignore[attr-defined]
        # paramiko keeps the interval privately; this is what Transport.set_keepalive(7) stored
        assert packetizer._Packetizer__keepalive_interval == 7
        sock = t._conn.transport.sock  # type: ignore[attr-defined]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 28000
    finally:
        t.close()


def test_jump_host_gateway(sshd: Sshd) -> None:
    t = SSHTransport(sshd.ssh_settings(jump=f"{sshd.user}@127.0.0.1:{sshd.port}"))
    try:
        assert t.run(["echo", "via-jump"]).stdout == b"via-jump\n"
        assert t._conn.gateway is not None  # type: ignore[attr-defined]
    finally:
        t.close()


def test_jump_host_key_errors_name_the_jump_host(sshd: Sshd, tmp_path: Path) -> None:
    import paramiko

    # The final host (127.0.0.1) is known; the jump host (localhost, same sshd) is not: the refusal must name
    # the jump host, not the host behind it.
    jump = f"{sshd.user}@localhost:{sshd.port}"
    with pytest.raises(TransportError) as exc:
        SSHTransport(sshd.ssh_settings(jump=jump)).run(["true"])
    msg = str(exc.value)
    assert msg.startswith(f"jump host {sshd.user}@localhost:{sshd.port}: host key not in known_hosts"), msg
    # a changed jump-host key: the ssh-keygen -R hint names the jump host's known_hosts entry
    other = paramiko.Ed25519Key.from_private_key_file(sshd.identity_file)
    kh = tmp_path / "known_hosts"
    kh.write_text(Path(sshd.known_hosts).read_text()
                  + f"[localhost]:{sshd.port} {other.get_name()} {other.get_base64()}\n")
    with pytest.raises(TransportError) as exc:
        SSHTransport(sshd.ssh_settings(jump=jump, known_hosts=str(kh))).run(["true"])
    msg = str(exc.value)
    assert msg.startswith(f"jump host {sshd.user}@localhost:{sshd.port}: HOST KEY MISMATCH"), msg
    assert f"ssh-keygen -R '[localhost]:{sshd.port}' -f {kh}" in msg, msg


def test_transport_for_builds_the_layers(sshd: Sshd, tmp_path: Path) -> None:
    p = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", name="box", pct=VMID, local_runs={})
    inv = parse_inventory(p.read_text(), base_dir=tmp_path)
    assert isinstance(transport_for(inv.hosts["local"]), LocalTransport)
    t = transport_for(inv.hosts["box"], inventory=inv)
    assert isinstance(t, PctTransport) and t.vmid == VMID and isinstance(t.inner, SSHTransport)
    plain = HostConfig(name="x", ssh=SSHSettings(host="h"))
    st = transport_for(plain, accept_new_host_key=True)
    assert isinstance(st, SSHTransport) and st.accept_new_host_key


def test_pct_status_reports_state_and_pct_errors(ssh: SSHTransport, pct_host: PctHost) -> None:
    pct_host.create(231, start=False)
    t = PctTransport(ssh, 231)
    assert t.status() == "stopped"
    with pytest.raises(TransportError, match="container '231' not running!"):
        r = t.run(["true"])
        raise TransportError(r.stderr.decode())
    with pytest.raises(TransportError, match=r"pct status 232: Configuration file .*232.conf' does not exist"):
        PctTransport(ssh, 232).status()
    with pytest.raises(ValueError):
        PctTransport(ssh, 99)


def test_preflight_is_each_layers_own_check(ssh: SSHTransport, pct_host: PctHost) -> None:
    """Verbs ask the stack, never its type: local and ssh have nothing to check, pct needs a running container."""
    assert LocalTransport().preflight() is None and ssh.preflight() is None
    pct_host.create(233, start=False)
    stopped = PctTransport(ssh, 233)
    assert isinstance(stopped, Transport)
    with pytest.raises(PreflightRefused, match=r"container 233 is stopped \(pct status 233\); start it with "
                                                r"`pct start 233` on the Proxmox host"):
        stopped.preflight()
    with pytest.raises(TransportError, match="pct status 234"):
        PctTransport(ssh, 234).preflight()  # no such container: pct's own error, the host could not say
    assert pct_host.pct("start", "233").returncode == 0
    try:
        assert stopped.preflight() == "container 233 running"
    finally:
        pct_host.pct("stop", "233")


def test_host_is_remote_when_commands_run_elsewhere() -> None:
    assert not HostConfig(name="l", local=True).is_remote
    assert HostConfig(name="c", local=True, pct=200).is_remote  # a container on this machine is elsewhere too
    assert HostConfig(name="s", ssh=SSHSettings(host="h")).is_remote


def test_ssh_config_supplies_hostname_port_user_and_key(sshd: Sshd, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host gpubox\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n  IdentityFile {sshd.identity_file}\n"
        "Host cfgonly\n  User mluser\n")
    (home / ".ssh" / "known_hosts").write_text(Path(sshd.known_hosts).read_text())
    monkeypatch.setenv("HOME", str(home))
    t = SSHTransport(SSHSettings(host="gpubox"))  # everything else from ~/.ssh/config
    try:
        assert t.run(["echo", "from-config"]).stdout == b"from-config\n"
        assert t.label == f"{sshd.user}@127.0.0.1:{sshd.port}"
    finally:
        t.close()
    inv = parse_inventory("hosts:\n  g:\n    ssh: {host: cfgonly}\n    runs:\n      r: {workdir: /w, command: [x], log: l}\n")
    # the run's own cache (issue 8): never the user's shared /tmp/torchinductor_<user>, whoever the user is
    assert inv.runs["g"]["r"].inductor_cache_dir == "/w/.opsctl/r/inductor"


def test_jump_naming_another_inventory_host(sshd: Sshd, tmp_path: Path) -> None:
    p = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", name="bastion")
    text = p.read_text()
    p.write_text(text + "".join(f"  {line}\n" for line in yaml_box(sshd).splitlines()))
    inv = parse_inventory(p.read_text(), base_dir=tmp_path)
    t = transport_for(inv.hosts["box"], inventory=inv)
    assert isinstance(t, SSHTransport)
    try:
        assert t.run(["echo", "hop"]).stdout == b"hop\n"
        gw = t._conn.gateway  # type: ignore[attr-defined]
        assert gw is not None and gw.port == sshd.port and gw.transport.is_active()
    finally:
        t.close()


def yaml_box(sshd: Sshd) -> str:
    return (f"box:\n  ssh:\n    host: 127.0.0.1\n    port: {sshd.port}\n    user: {sshd.user}\n"
            f"    identity_file: {sshd.identity_file}\n    known_hosts: {sshd.known_hosts}\n"
            "    use_ssh_config: false\n    jump: bastion\n")


@pytest.mark.parametrize("layers", ["ssh", "ssh+pct"])
def test_hostile_hosts_yaml_values_reach_the_host_verbatim(sshd: Sshd, ct: int, tmp_path: Path, layers: str) -> None:
    canary = tmp_path / "pwned"
    c = shlex.quote(str(canary))
    evil = f"x $(touch {c}) `touch {c}`; touch {c} 'q' \"d\" *\n&& touch {c}"
    runs = {"evil": {
        "workdir": f"/tmp/dflash {evil}".replace("\n", " "),
        "command": ["python3", "-c", "import sys; print(sys.argv)", evil],
        "env": {"EVIL": evil},
        "log": f"logs/{evil}.log",
        "tmux_session": f"dflash-{evil}".replace("\n", " "),
    }}
    p = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs=runs, pct=ct if layers == "ssh+pct" else None)
    inv = load_inventory(p)
    host, run = resolve(inv, "box", "evil")
    assert run is not None and run.env["EVIL"] == evil and run.argv[-1] == evil
    t = transport_for(host, inventory=inv)
    try:
        values = [run.workdir, run.log, run.tmux_session or "", *run.argv, run.env["EVIL"]]
        r = t.run(["printf", "%s\\0", *values])
        assert r.rc == 0, r.stderr
        assert r.stdout.split(b"\0")[:-1] == [v.encode() for v in values]
    finally:
        t.close()
    assert not canary.exists()


def test_hashed_known_hosts_entries_are_honoured(sshd: Sshd, tmp_path: Path) -> None:
    import subprocess

    kh = tmp_path / "known_hosts"
    kh.write_text("@revoked * ssh-rsa AAAA\n" + Path(sshd.known_hosts).read_text())
    subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert "127.0.0.1" not in kh.read_text()  # really hashed
    t = SSHTransport(sshd.ssh_settings(known_hosts=str(kh)))
    try:
        assert t.run(["true"]).rc == 0
    finally:
        t.close()
