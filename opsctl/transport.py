"""Transports that run an argv on a host: local (subprocess), SSH (Fabric/paramiko), and Proxmox `pct exec` on top.

Every command is an argv list; each shell layer quotes it exactly once (shell_join), so hosts.yaml values never become code.
"""

from __future__ import annotations

import logging
import os
import selectors
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

from opsctl.config import HostConfig, Inventory, SSHSettings

STDERR_KEEP = 1 << 20  # bytes of a stream's stderr kept for error messages
EXIT_GRACE_S = 2.0  # after a command exits, how long run() still collects output its leftover children write

# paramiko logs a dropped connection as "Socket exception: ..." through logging's last-resort stderr handler,
# in the middle of a user's terminal; we report drops as TransportError instead. `-v` logging still sees them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class TransportError(Exception):
    """The host could not be reached or the channel broke; the message says what to do about it."""


class TransportTimeout(TransportError, TimeoutError):
    """A command or a wait did not finish within its timeout."""


class PreflightRefused(Exception):
    """The host answered, and a layer cannot run commands there now (a stopped container); exit 5, not 3."""


class PermanentTransportError(TransportError):
    """Retrying cannot help until a person acts: host key unknown or changed, authentication refused, a host
    name that does not resolve. `logs -f` and `launch --follow` exit 3 on it at once instead of retrying.

    `kind` is `host_key`, `auth` or `dns`; a `dns` failure after the link once worked may be a resolver
    outage, so followers treat only a first-connection `dns` failure as permanent."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Completed(NamedTuple):
    """A finished command: exit code and its raw output bytes (unpacks as `rc, out, err`)."""

    rc: int
    stdout: bytes
    stderr: bytes


def shell_join(argv: list[str]) -> str:
    """Quote argv for ONE POSIX shell layer; the only place opsctl quotes, called once per layer crossed."""
    if not isinstance(argv, list) or not argv:
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    for a in argv:
        if not isinstance(a, str):
            raise ValueError(f"argv elements must be str, got {a!r} in {argv!r}")
        if "\x00" in a:
            raise ValueError(f"argv element {a!r} contains a NUL byte, which no exec can pass")
    return shlex.join(argv)


def _check_argv(argv: list[str]) -> None:
    shell_join(argv)


class Stream:
    """A long-running remote process: read `stdout` lines, `write` to its stdin, `close` to send EOF.

    Lines are bytes and keep their trailing b"\\n" (the last one may lack it); iteration blocks on the
    channel, it never sleeps. Closing stdin is how the remote side learns that the client went away.
    """

    stdout: Iterator[bytes]

    def __init__(self) -> None:
        self._stderr = bytearray()
        self._stderr_lock = threading.Lock()

    def _keep_stderr(self, data: bytes) -> None:
        with self._stderr_lock:
            self._stderr += data
            if len(self._stderr) > STDERR_KEEP:
                del self._stderr[: len(self._stderr) - STDERR_KEEP]

    @property
    def stderr(self) -> bytes:
        """What the process wrote to stderr so far (the last STDERR_KEEP bytes)."""
        with self._stderr_lock:
            return bytes(self._stderr)

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@runtime_checkable
class Transport(Protocol):
    """Runs argv lists on one host. Implementations: LocalTransport, SSHTransport, PctTransport."""

    def argv_for(self, argv: list[str]) -> list[str] | str: ...

    def run(self, argv: list[str], input: bytes | None = None, timeout: float | None = None) -> Completed: ...

    def stream(self, argv: list[str], stdin_data: bytes = b"") -> Stream: ...

    def preflight(self) -> str | None:
        """Check that this stack can run commands now (e.g. its container is running), before a verb starts.

        Returns what was checked, for the operator (None: nothing to check); raises PreflightRefused when the
        host answered no, TransportError when it could not be asked."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------------
# local


class _LocalStream(Stream):
    def __init__(self, proc: subprocess.Popen[bytes], what: str) -> None:
        super().__init__()
        self._proc = proc
        self._what = what
        assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
        self.stdout = iter(proc.stdout.readline, b"")
        self._stderr_thread = threading.Thread(target=self._drain, args=(proc.stderr,), daemon=True)
        self._stderr_thread.start()

    def _drain(self, f: object) -> None:
        for chunk in iter(lambda: f.read1(65536), b""):  # type: ignore[attr-defined]
            self._keep_stderr(chunk)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError) as e:
            raise TransportError(f"{self._what}: the process no longer reads its stdin ({e})") from None

    def close(self) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        try:
            rc = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TransportTimeout(f"{self._what}: still running after {timeout}s") from None
        self._stderr_thread.join(5)
        return rc

    def kill(self) -> None:
        # The stream runs in its own session (start_new_session), so its process group is exactly its tree.
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.close()
        self._proc.wait()
        self._stderr_thread.join(2)


def _communicate(proc: subprocess.Popen[bytes], input: bytes | None, timeout: float | None) -> tuple[bytes, bytes]:
    """Like Popen.communicate, but returns EXIT_GRACE_S after the process exits even if a background child
    it started (`daemon &`, `nohup x &`) still holds stdout open: the classic ssh hang of PAIN.md."""
    deadline = None if timeout is None else time.monotonic() + timeout
    bufs: dict[int, bytearray] = {}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        assert f is not None
        bufs[f.fileno()] = bytearray()
        sel.register(f.fileno(), selectors.EVENT_READ)
    pending = memoryview(input or b"")
    stdin_fd = -1
    if proc.stdin is not None:
        stdin_fd = proc.stdin.fileno()
        os.set_blocking(stdin_fd, False)
        if pending:
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ)
    exited_at: float | None = None
    try:
        while any(fd in bufs for fd in sel.get_map()):
            now = time.monotonic()
            waits = [t for t in (deadline, None if exited_at is None else exited_at + EXIT_GRACE_S) if t is not None]
            if waits and min(waits) <= now:
                if deadline is not None and deadline <= now:
                    raise TransportTimeout(f"timed out after {timeout}s")
                break  # exited, grace over: a daemonized child keeps the pipe; we do not wait for it
            for key, _ in sel.select(min(waits) - now if waits else None):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    exited_at = time.monotonic()
                elif fd == stdin_fd:
                    try:
                        n = os.write(fd, pending[:65536])
                        pending = pending[n:]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()  # type: ignore[union-attr]
                else:
                    data = os.read(fd, 65536)
                    if data:
                        bufs[fd] += data
                    else:
                        sel.unregister(fd)
    finally:
        sel.close()
        os.close(pidfd)
    proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()) + EXIT_GRACE_S)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()])
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None and not f.closed:
            f.close()
    return out, err


class LocalTransport:
    """Runs argv directly with subprocess (no shell at all). `env` adds to (or overrides) os.environ."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._env = dict(env) if env else None

    def _environ(self) -> dict[str, str] | None:
        return {**os.environ, **self._env} if self._env else None

    def argv_for(self, argv: list[str]) -> list[str]:
        _check_argv(argv)
        return list(argv)

    def run(self, argv: list[str], input: bytes | None = None, timeout: float | None = None) -> Completed:
        cmd = self.argv_for(argv)
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self._environ(),
                                    start_new_session=True)
        except FileNotFoundError:
            # What a shell (and therefore ssh) reports, so callers see one behaviour on every transport.
            return Completed(127, b"", f"{cmd[0]}: command not found\n".encode())
        except PermissionError as e:
            return Completed(126, b"", f"{cmd[0]}: {e.strerror}\n".encode())
        try:
            out, err = _communicate(proc, input, timeout)
        except TransportTimeout:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
            raise TransportTimeout(f"timed out after {timeout}s (killed): {shell_join(cmd)}") from None
        return Completed(proc.returncode, out, err)

    def stream(self, argv: list[str], stdin_data: bytes = b"") -> Stream:
        cmd = self.argv_for(argv)
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=self._environ(), start_new_session=True)
        except OSError as e:
            raise TransportError(f"cannot start {cmd[0]!r}: {e.strerror or e}") from None
        s = _LocalStream(proc, shell_join(cmd)[:200])
        if stdin_data:
            s.write(stdin_data)
        return s

    def preflight(self) -> str | None:
        return None  # this machine runs commands whenever we do

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "LocalTransport()"


# ---------------------------------------------------------------------------------------------------------------
# ssh


def _parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    if "," in spec:
        raise TransportError(f"jump {spec!r}: several hops are not supported in hosts.yaml; put them in "
                             f"~/.ssh/config as ProxyJump (use_ssh_config: true) or name another inventory host")
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.count(":") == 1:
        host, p = rest.split(":")
        if not p.isdigit():
            raise TransportError(f"jump host {spec!r}: port {p!r} is not a number")
        port = int(p)
    return (user or None), host, port


def _tcp_dead_peer_detection(sock: object, keepalive_s: int) -> None:
    """Make a silently dead peer (cable pulled, VM gone) an error within ~4 x keepalive_s, not TCP's ~15 minutes.

    paramiko's keepalive only sends packets; with TCP_USER_TIMEOUT unacknowledged data (those packets included)
    fails the socket, which closes every channel, so a blocked stream read ends instead of hanging forever.
    """
    if not isinstance(sock, socket.socket):
        return  # a gateway channel or ProxyCommand: the first hop's socket carries the detection
    # Small request/response packets (channel open, exit status, one log line) must not wait for Nagle.
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1), (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    for name, value in (("TCP_KEEPIDLE", keepalive_s), ("TCP_KEEPINTVL", keepalive_s), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", 4 * keepalive_s * 1000)):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            pass


class _SSHStream(Stream):
    def __init__(self, chan: object, what: str, transport: object) -> None:
        super().__init__()
        self._chan = chan
        self._what = what
        self._transport = transport
        self._out = chan.makefile("rb")  # type: ignore[attr-defined]
        self.stdout = self._lines()
        self._stderr_thread = threading.Thread(target=self._drain, daemon=True)
        self._stderr_thread.start()

    def _lines(self) -> Iterator[bytes]:
        while True:
            try:
                line = self._out.readline()
            except (OSError, EOFError):
                return
            if not line:
                return
            yield line

    def _drain(self) -> None:
        while True:
            try:
                chunk = self._chan.recv_stderr(65536)  # type: ignore[attr-defined]
            except (OSError, EOFError):
                return
            if not chunk:
                return
            self._keep_stderr(chunk)

    def write(self, data: bytes) -> None:
        try:
            self._chan.sendall(data)  # type: ignore[attr-defined]
        except (OSError, EOFError) as e:
            raise TransportError(f"{self._what}: channel closed ({e or 'connection lost'})") from None

    def close(self) -> None:
        try:
            self._chan.shutdown_write()  # type: ignore[attr-defined]
        except (OSError, EOFError):
            pass

    def wait(self, timeout: float | None = None) -> int:
        if not self._chan.status_event.wait(timeout):  # type: ignore[attr-defined]
            raise TransportTimeout(f"{self._what}: still running after {timeout}s")
        rc = int(self._chan.exit_status)  # type: ignore[attr-defined]
        if rc == -1 and not self._transport.is_active():  # type: ignore[attr-defined]
            raise TransportError(f"{self._what}: SSH connection lost before the command finished")
        self._stderr_thread.join(5)
        return rc

    def kill(self) -> None:
        # SSH cannot signal a remote process portably: closing the channel closes its pipes, so the remote side
        # sees EOF on stdin and EPIPE on its next write (the agent exits on either; see docs/agent-protocol.md).
        try:
            self._chan.close()  # type: ignore[attr-defined]
        except (OSError, EOFError):
            pass
        self._stderr_thread.join(2)


def _load_known_hosts(client: object, path: Path) -> None:
    """Add every plain or hashed entry of an OpenSSH known_hosts file to the client; never write the file.

    paramiko's own loader aborts on `@cert-authority` / `@revoked` lines, and its save would rewrite the user's
    file without them; those markers (which paramiko cannot use anyway) and unparsable lines are skipped here.
    """
    from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

    keys = client.get_host_keys()  # type: ignore[attr-defined]
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "@")):
            continue
        try:
            entry = HostKeyEntry.from_line(line)
        except (InvalidHostKey, ValueError, TypeError, IndexError):
            continue
        if entry is None or entry.key is None:
            continue
        for name in entry.hostnames:
            keys.add(name, entry.key.get_name(), entry.key)


class _AppendNewHostKey:
    """--accept-new-host-key: trust an *unknown* key and append one line for it to known_hosts (never rewrite).

    Only called for hosts absent from known_hosts; a changed key raises BadHostKeyException before this.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def missing_host_key(self, client: object, hostname: str, key: object) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"  # type: ignore[attr-defined]
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size and not self.path.read_bytes().endswith(b"\n"):
                line = "\n" + line
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        client.get_host_keys().add(hostname, key.get_name(), key)  # type: ignore[attr-defined]


class SSHTransport:
    """Runs argv over one SSH connection (Fabric `Connection`), opened on first use and re-opened after a drop.

    Fabric resolves ~/.ssh/config (User, Port, IdentityFile, ProxyJump); commands run on raw paramiko channels
    because Fabric's runner decodes output to text and we need bytes-exact lines. Host keys are verified against
    known_hosts with RejectPolicy unless `accept_new_host_key`, which adds and saves an unknown key (a *changed*
    key is always refused).
    """

    def __init__(self, settings: SSHSettings, accept_new_host_key: bool = False,
                 jump: SSHSettings | None = None) -> None:
        self.settings = settings
        self.accept_new_host_key = accept_new_host_key
        self._jump_settings = jump
        self._conn: object | None = None
        self._resolved: tuple[str | None, str, int] | None = None
        self._lock = threading.Lock()

    # -- connection ----------------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        # After connecting, what Fabric resolved (~/.ssh/config HostName/User/Port), else what hosts.yaml says.
        user, host, port = self._resolved or (self.settings.user, self.settings.host, self.settings.port)
        return f"{user + '@' if user else ''}{host}:{port}"

    def _known_hosts(self) -> Path:
        return Path(self.settings.known_hosts or "~/.ssh/known_hosts").expanduser()

    def _client(self) -> object:
        import paramiko

        client = paramiko.SSHClient()
        known_hosts = self._known_hosts()
        files = [known_hosts] if known_hosts.exists() else []
        if self.settings.known_hosts is None and Path("/etc/ssh/ssh_known_hosts").is_file():
            files.append(Path("/etc/ssh/ssh_known_hosts"))
        for f in files:
            try:
                _load_known_hosts(client, f)
            except (OSError, UnicodeDecodeError) as e:
                raise TransportError(f"{self.label}: cannot read known_hosts file {f}: {e}") from None
        client.set_missing_host_key_policy(_AppendNewHostKey(known_hosts) if self.accept_new_host_key
                                           else paramiko.RejectPolicy())
        return client

    def _connection(self, s: SSHSettings, gateway: object | None) -> object:
        import paramiko
        from fabric import Config, Connection

        config = Config() if s.use_ssh_config else Config(ssh_config=paramiko.SSHConfig())
        kwargs: dict[str, object] = {"banner_timeout": s.connect_timeout, "auth_timeout": s.connect_timeout,
                                     "channel_timeout": s.connect_timeout}
        if s.identity_file:
            # An explicit key means exactly that key: no agent, no ~/.ssh/id_* guessing (like IdentitiesOnly).
            kwargs.update(key_filename=s.identity_file, look_for_keys=False, allow_agent=False)
        # A port left at its default lets ~/.ssh/config's Port apply (Fabric falls back to 22 itself).
        port = s.port if ("port" in s.model_fields_set or not s.use_ssh_config) else None
        conn = Connection(s.host, user=s.user, port=port, config=config, gateway=gateway,
                          connect_timeout=s.connect_timeout, connect_kwargs=kwargs)
        # Fabric's default client auto-adds unknown host keys; every hop (incl. ProxyJump gateways from
        # ~/.ssh/config) gets our host-key policy and a connect timeout.
        for hop in self._hops(conn):
            hop.client = self._client()  # type: ignore[attr-defined]
            if not hop.connect_timeout:  # type: ignore[attr-defined]
                hop.connect_timeout = s.connect_timeout  # type: ignore[attr-defined]
        return conn

    @staticmethod
    def _hops(conn: object) -> list[object]:
        hops: list[object] = []
        c: object | None = conn
        while c is not None and not isinstance(c, str):  # a str gateway is a ProxyCommand
            hops.append(c)
            c = getattr(c, "gateway", None)
        return hops

    @staticmethod
    def _hop_label(hop: object) -> str:
        user = getattr(hop, "user", None)
        return f"{user + '@' if user else ''}{hop.host}:{hop.port}"  # type: ignore[attr-defined]

    def _open_hop(self, hop: object, label: str) -> None:
        """Connect one hop, turning paramiko's exceptions into errors that name `label` and say what to do."""
        import paramiko

        known_hosts = self._known_hosts()
        kh_name = hop.host if int(hop.port) == 22 else f"[{hop.host}]:{hop.port}"  # type: ignore[attr-defined]
        try:
            hop.open()  # type: ignore[attr-defined]
        except paramiko.BadHostKeyException as e:
            raise PermanentTransportError(
                f"{label}: HOST KEY MISMATCH: the server presented {e.key.get_name()} "
                f"{e.key.fingerprint} but {known_hosts} has a different key for it. This may be an attack or a "
                f"reinstalled host; if you know it was reinstalled, remove the old entry with "
                f"`ssh-keygen -R '{kh_name}' -f {known_hosts}` and connect again.", "host_key") from None
        except paramiko.AuthenticationException as e:
            key = self.settings.identity_file or "your ssh agent / default keys"
            raise PermanentTransportError(f"{label}: authentication failed ({e}); tried {key}. Check `user:` and "
                                          f"`identity_file:` in hosts.yaml and the server's authorized_keys.",
                                          "auth") from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise PermanentTransportError(
                    f"{label}: host key not in known_hosts ({known_hosts}); verify the host, then re-run with "
                    f"--accept-new-host-key to trust and save it.", "host_key") from None
            raise TransportError(f"{label}: SSH error: {e}") from None
        except EOFError:
            # paramiko's key exchange reads EOF when the connection drops mid-handshake (a flapping link, sshd
            # restarting, MaxStartups): transient, so a reconnect loop retries it like any other drop
            raise TransportError(f"{label}: the connection closed during the SSH handshake") from None
        except TimeoutError:
            raise TransportTimeout(f"{label}: no answer within connect_timeout={self.settings.connect_timeout}s "
                                   f"(host down, firewalled, or wrong port?)") from None
        except socket.gaierror as e:
            raise PermanentTransportError(f"{label}: cannot resolve host name {hop.host!r} ({e.strerror})",  # type: ignore[attr-defined]
                                          "dns") from None
        except (paramiko.ssh_exception.NoValidConnectionsError, OSError) as e:
            # paramiko's NoValidConnectionsError says "[Errno None] Unable to connect"; the errno text per
            # address ("Connection refused", "No route to host") is what a person needs to see.
            errs = getattr(e, "errors", None)
            why = "; ".join(sorted({x.strerror or str(x) for x in errs.values()})) if errs else str(e)
            raise TransportError(f"{label}: unreachable ({why}); is sshd running and the port right?") from None

    def _open(self) -> object:
        gateway = None
        if self._jump_settings is not None:
            gateway = self._connection(self._jump_settings, None)
        elif self.settings.jump:
            user, host, port = _parse_jump(self.settings.jump)
            js = SSHSettings(host=host, user=user, port=port or 22, connect_timeout=self.settings.connect_timeout,
                             keepalive_s=self.settings.keepalive_s, known_hosts=self.settings.known_hosts,
                             identity_file=self.settings.identity_file, use_ssh_config=self.settings.use_ssh_config)
            gateway = self._connection(js, None)
        conn = self._connection(self.settings, gateway)
        self._resolved = (conn.user, conn.host, int(conn.port))  # type: ignore[attr-defined]
        hops = self._hops(conn)
        # Open the hops outermost first (Fabric's open() skips a hop already connected), so an error names the
        # hop it is about: an unknown or changed jump-host key is the jump host's, with its known_hosts entry.
        for hop in reversed(hops):
            try:
                self._open_hop(hop, self.label if hop is conn else "jump host " + self._hop_label(hop))
            except BaseException:
                for h in hops:
                    h.close()  # type: ignore[attr-defined]  # a failed handshake must not leave a socket behind
                raise
        for hop in self._hops(conn):
            if getattr(hop, "transport", None) is not None:
                hop.transport.set_keepalive(self.settings.keepalive_s)  # type: ignore[attr-defined]
                _tcp_dead_peer_detection(hop.transport.sock, self.settings.keepalive_s)  # type: ignore[attr-defined]
        return conn

    def connect(self) -> None:
        """Open the connection now (otherwise the first command opens it); re-opens a dropped one."""
        self._transport()

    @property
    def is_connected(self) -> bool:
        c = self._conn
        return c is not None and bool(c.is_connected)  # type: ignore[attr-defined]

    def _transport(self) -> object:
        with self._lock:
            if self._conn is None or not self._conn.is_connected:  # type: ignore[attr-defined]
                self._drop_connection()
                self._conn = self._open()
            return self._conn.transport  # type: ignore[attr-defined]

    def _drop_connection(self) -> None:
        """Forget the current connection (closing it if it still can be); the caller holds the lock."""
        if self._conn is not None:
            try:
                self._conn.close()  # type: ignore[attr-defined]
            except Exception:
                pass
            self._conn = None

    def _session(self, cmd: str) -> object:
        last: Exception | None = None
        for _attempt in range(2):
            t = self._transport()
            try:
                chan = t.open_session(timeout=self.settings.connect_timeout)  # type: ignore[attr-defined]
                chan.exec_command(cmd)
                return chan
            except Exception as e:
                # A connection that died a moment ago can still look active; the exec never ran, so one fresh
                # connection and one retry is safe.
                last = e
                with self._lock:
                    self._drop_connection()
        raise TransportError(f"{self.label}: cannot start a command on the SSH connection ({last or type(last).__name__})")

    # -- Transport API -------------------------------------------------------------------------------------
    def argv_for(self, argv: list[str]) -> str:
        # sshd hands the string to the remote user's login shell: exactly one POSIX-shell layer.
        return shell_join(argv)

    def run(self, argv: list[str], input: bytes | None = None, timeout: float | None = None) -> Completed:
        cmd = self.argv_for(argv)
        chan = self._session(cmd)
        out, err = bytearray(), bytearray()

        def reader(recv: object, buf: bytearray) -> None:
            while True:
                try:
                    data = recv(65536)  # type: ignore[operator]
                except (OSError, EOFError):
                    return
                if not data:
                    return
                buf += data

        def writer() -> None:
            try:
                if input:
                    chan.sendall(input)  # type: ignore[attr-defined]
                chan.shutdown_write()  # type: ignore[attr-defined]
            except (OSError, EOFError):
                pass

        threads = [threading.Thread(target=reader, args=(chan.recv, out), daemon=True),  # type: ignore[attr-defined]
                   threading.Thread(target=reader, args=(chan.recv_stderr, err), daemon=True),  # type: ignore[attr-defined]
                   threading.Thread(target=writer, daemon=True)]
        for th in threads:
            th.start()
        if not chan.status_event.wait(timeout):  # type: ignore[attr-defined]
            chan.close()  # type: ignore[attr-defined]
            raise TransportTimeout(f"{self.label}: timed out after {timeout}s: {cmd[:200]}")
        # The output ends at EOF, which a daemonized child holding stdout may never send: wait a grace period.
        for th in threads[:2]:
            th.join(EXIT_GRACE_S)
        rc = int(chan.exit_status)  # type: ignore[attr-defined]
        if rc == -1 and not self._conn_active():
            raise TransportError(f"{self.label}: SSH connection lost while running: {cmd[:200]}")
        chan.close()  # type: ignore[attr-defined]
        return Completed(rc, bytes(out), bytes(err))

    def _conn_active(self) -> bool:
        c = self._conn
        return c is not None and c.transport is not None and c.transport.is_active()  # type: ignore[attr-defined]

    def stream(self, argv: list[str], stdin_data: bytes = b"") -> Stream:
        cmd = self.argv_for(argv)
        chan = self._session(cmd)
        s = _SSHStream(chan, f"{self.label}: {cmd[:200]}", chan.get_transport())  # type: ignore[attr-defined]
        if stdin_data:
            s.write(stdin_data)
        return s

    def preflight(self) -> str | None:
        return None  # reachability is proven by the agent's stream itself (exit 3 when it fails)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()  # type: ignore[attr-defined]
                finally:
                    self._conn = None

    def __repr__(self) -> str:
        return f"SSHTransport({self.label})"


# ---------------------------------------------------------------------------------------------------------------
# pct


class PctTransport:
    """Runs argv inside Proxmox container `vmid` as `pct exec VMID -- argv...`, through `inner` (local or SSH).

    `pct exec` hands its extra args to `lxc-attach -- ...` as an argv (no shell on the Proxmox side); the `--`
    is always there so an argv starting with '-' is never taken as a pct option. The inner layer quotes once.
    """

    def __init__(self, inner: Transport, vmid: int, pct: str = "pct") -> None:
        if not isinstance(vmid, int) or isinstance(vmid, bool) or vmid < 100:
            raise ValueError(f"vmid must be an integer >= 100, got {vmid!r}")
        self.inner = inner
        self.vmid = vmid
        self.pct = pct

    def wrap(self, argv: list[str]) -> list[str]:
        """The argv the inner transport runs on the Proxmox host."""
        _check_argv(argv)
        return [self.pct, "exec", str(self.vmid), "--", *argv]

    def argv_for(self, argv: list[str]) -> list[str] | str:
        return self.inner.argv_for(self.wrap(argv))

    def run(self, argv: list[str], input: bytes | None = None, timeout: float | None = None) -> Completed:
        return self.inner.run(self.wrap(argv), input=input, timeout=timeout)

    def stream(self, argv: list[str], stdin_data: bytes = b"") -> Stream:
        return self.inner.stream(self.wrap(argv), stdin_data)

    def status(self, timeout: float | None = 30) -> str:
        """`running` / `stopped` / ... from `pct status VMID`; raises TransportError with pct's message."""
        r = self.inner.run([self.pct, "status", str(self.vmid)], timeout=timeout)
        text = r.stdout.decode(errors="replace").strip()
        if r.rc != 0 or not text.startswith("status: "):
            msg = (r.stderr.decode(errors="replace").strip() or text or f"exit code {r.rc}")
            raise TransportError(f"pct status {self.vmid}: {msg}")
        return text.split(": ", 1)[1]

    def preflight(self) -> str | None:
        """Refuse early and clearly when the container is not running (the agent would run inside it)."""
        self.inner.preflight()
        state = self.status()
        if state != "running":
            raise PreflightRefused(f"container {self.vmid} is {state} (pct status {self.vmid}); start it with "
                                   f"`pct start {self.vmid}` on the Proxmox host")
        return f"container {self.vmid} running"

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"PctTransport({self.inner!r}, {self.vmid})"


def transport_for(host: HostConfig, accept_new_host_key: bool = False, inventory: Inventory | None = None) -> Transport:
    """The transport stack for a host: local | ssh, plus `pct exec` when the host names a container.

    `inventory` lets `ssh.jump` name another host of the inventory (its ssh settings become the gateway).
    """
    inner: Transport
    if host.local:
        inner = LocalTransport()
    elif host.ssh is not None:
        jump = None
        if host.ssh.jump and inventory is not None and host.ssh.jump in inventory.hosts:
            jump = inventory.hosts[host.ssh.jump].ssh
        inner = SSHTransport(host.ssh, accept_new_host_key=accept_new_host_key, jump=jump)
    else:  # pragma: no cover - HostConfig validation forbids it
        raise TransportError(f"host {host.name!r} has neither `local: true` nor `ssh:`")
    if host.pct is not None:
        return PctTransport(inner, host.pct)
    return inner
