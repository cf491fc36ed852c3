"""The opsctl inventory: hosts.yaml -> validated pydantic models (hosts, how to reach them, and their runs).

Errors name the file, the line and the field path, so a typo in hosts.yaml is fixed in seconds, not debugged.
"""

from __future__ import annotations

import difflib
import json
import os
import posixpath
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash import yamlfile
from opsctl.group import Checks, GroupProblems, parse_groups  # hosts.yaml `groups:` (below this module)
from opsctl.remote.base import SYSTEM_DIRS  # the agent checks the same list again on the host
from opsctl.remote.rules import TAU_DROP_FRAC, TAU_DROP_MIN  # the wrapper notifies by the same defaults

PYTHON_PLACEHOLDER = "{python}"
DEFAULT_HOSTS_FILE = "hosts.yaml"
ENV_HOSTS_FILE = "OPSCTL_HOSTS"
VMID_MIN, VMID_MAX = 100, 999_999_999  # Proxmox's pve-vmid range
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# The inventory used when no hosts.yaml exists: the training core's tiny CPU run on this machine. Its config is the
# copy of configs/tiny.yaml shipped inside the dflash package (builtin_tiny_config), by absolute path, so the run
# starts from any directory and from an installed package, not only from the repository checkout.
# tests/test_config.py checks that the shipped hosts.yaml defines the same `local`/`tiny`.
TINY_CONFIG_PLACEHOLDER = '"{dflash_tiny_config}"'
DEFAULT_HOSTS_YAML = """\
hosts:
  local:
    local: true
    runs:
      tiny:
        workdir: .
        command: ["{python}", -m, dflash, train, --config, "{dflash_tiny_config}", --out, runs/tiny, --resume, auto]
        log: runs/tiny/train.log
        events: runs/tiny/events.jsonl
        tmux_session: dflash-tiny
        ready_timeout: 600
"""


def builtin_tiny_config() -> Path | None:
    """The tiny run's config as shipped in the dflash package (dflash/configs/tiny.yaml, package data: in a checkout a
    link to the repository's configs/tiny.yaml, in a wheel a copy of it). None when the install has no such file
    (e.g. imported from a zip), so callers say what to do instead of failing later inside the run."""
    from importlib.resources import files

    try:
        res = files("dflash").joinpath("configs", "tiny.yaml")
    except (ModuleNotFoundError, TypeError):
        return None
    path = Path(str(res))
    return path if path.is_file() else None


def default_hosts_yaml() -> str:
    """DEFAULT_HOSTS_YAML with the tiny run's --config pointing at the packaged config (builtin_tiny_config), as a
    YAML double-quoted string; without one, the checkout-relative configs/tiny.yaml (launch's preflight then says
    it is missing)."""
    path = builtin_tiny_config()
    return DEFAULT_HOSTS_YAML.replace(TINY_CONFIG_PLACEHOLDER, json.dumps(str(path) if path else "configs/tiny.yaml"))


class Problem(NamedTuple):
    """One hosts.yaml problem: where it is and what is wrong; printed as `FILE:LINE: field.path: message`."""

    file: str
    line: int | None
    field: str  # dotted path, e.g. hosts.gpu1.ssh.port
    message: str


class InventoryError(Exception):
    """A hosts.yaml problem; str() is one `FILE:LINE: field.path: message` line per problem."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(_format_problem(*p) for p in problems))


def _format_problem(file: str, line: int | None, path: str, msg: str) -> str:
    return yamlfile.format_problem(file, line, path, msg)  # the one spelling both config loaders print


def dangerous_path_reason(path: str) -> str | None:
    """Why deleting inside `path` could destroy something that is not ours (None when it is acceptable).

    Shared by config validation and `clean`, so the rule that protects `/`, `~` and system trees lives in one place.
    """
    if not isinstance(path, str) or not path.strip():
        return "empty path"
    if path.startswith("~"):
        return f"{path!r} starts with '~' (home directories are never cleaned; write an absolute path)"
    if not path.startswith("/"):
        return f"{path!r} is not absolute"
    if "\x00" in path or "\n" in path:
        return f"{path!r} contains a NUL or newline"
    parts = path.split("/")
    if ".." in parts or "." in parts[1:]:
        return f"{path!r} contains '.' or '..' components"
    norm = posixpath.normpath(path)
    if norm in ("/", "//"):
        return "'/' is never cleaned"
    if norm in SYSTEM_DIRS:
        return f"{norm!r} is a system directory; use a dedicated subdirectory (e.g. {norm}/torchinductor_<user>)"
    if norm.count("/") < 2 and norm not in ("/scratch",):
        return f"{norm!r} is a top-level directory; use a dedicated subdirectory"
    return None


def path_is_within(path: str, root: str) -> bool:
    """True when `path` is `root` or lies under it (purely lexical: both are absolute and normalized)."""
    p, r = posixpath.normpath(path), posixpath.normpath(root)
    return p == r or p.startswith(r.rstrip("/") + "/")


def protected_paths(run: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's own paths that an emptied cache dir must never be, nor contain: (field name, path)."""
    return [(k, run[k]) for k in ("workdir", "state_dir", "log", "events", "model_dir", "checkpoint_dir")
            if isinstance(run.get(k), str) and run[k]]


def cache_overlap(cache: str, protected: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The first protected (name, path) that `cache` is equal to or an ancestor of; None when there is none."""
    for name, p in protected:
        if path_is_within(p, cache):
            return name, p
    return None


def _scalar_to_str(v: Any) -> Any:
    # YAML turns `OMP_NUM_THREADS: 4` into an int; an env value is text, so accept numbers as their text.
    if isinstance(v, bool):
        raise ValueError("booleans are ambiguous as environment values; quote them ('1', 'true')")
    if isinstance(v, int | float):
        return str(v)
    return v


EnvValue = Annotated[str, BeforeValidator(_scalar_to_str)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class SSHSettings(_Strict):
    """How to reach a host over SSH. Unset values fall back to ~/.ssh/config (when use_ssh_config), then ssh defaults."""

    host: str
    user: str | None = None
    port: int = Field(22, ge=1, le=65535)
    identity_file: str | None = None
    jump: str | None = None  # another host's name in this inventory, or [user@]host[:port]
    connect_timeout: float = Field(10.0, gt=0)
    keepalive_s: int = Field(15, gt=0)
    use_ssh_config: bool = True
    known_hosts: str | None = None  # default: ~/.ssh/known_hosts

    @field_validator("host", "user", "jump")
    @classmethod
    def _no_option_like(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v or v != v.strip() or any(c.isspace() for c in v):
            raise ValueError(f"{v!r} must be non-empty and contain no whitespace")
        if v.startswith("-"):
            raise ValueError(f"{v!r} must not start with '-'")
        return v


def _notify_argv(v: list[str] | None) -> list[str] | None:
    if v is not None and (not v or not v[0] or any("\x00" in a for a in v)):
        raise ValueError("notify is an argv list (e.g. [curl, -d, ...]): non-empty, no NUL bytes")
    return v


class RestartPolicy(_Strict):
    """What the run's wrapper does on the host when an attempt crashes (no client needs to be connected).

    A kill by opsctl, or an attempt that ended on a signal, never restarts: someone wanted it to stop."""

    when: Literal["never", "on-failure"] = "never"
    max: int = Field(3, ge=1)  # restarts (not attempts): max 3 = at most 4 attempts per launch
    backoff_s: float = Field(60.0, ge=0)  # wait after a crash before the next attempt
    within_s: float | None = Field(None, gt=0)  # count only restarts in this window (default: all since launch)
    # appended to the command for a restart, unless it already carries them (e.g. [--resume, auto] for dflash)
    resume_args: list[str] = []

    @field_validator("resume_args")
    @classmethod
    def _resume(cls, v: list[str]) -> list[str]:
        if any(not a or "\x00" in a for a in v):
            raise ValueError("resume_args are non-empty strings without NUL bytes")
        return v


class HostConfig(_Strict):
    """One machine (or Proxmox container on a machine) that runs training jobs."""

    name: str
    local: bool = False
    ssh: SSHSettings | None = None
    pct: int | None = None  # Proxmox container VMID: commands run as `pct exec VMID -- argv...` on that host
    python: str = "python3"  # interpreter used for the remote agent and for `{python}` in commands
    gpus: list[int] | None = None
    # `logs -f` / `launch --follow`: how long to keep retrying a lost link (seconds; 0 = forever). Permanent
    # errors (host key unknown or changed, authentication refused, unknown host) never retry.
    reconnect_timeout: float = Field(300.0, ge=0)
    # argv the run's wrapper runs on the host on crashed / finished / stalled / restarting (runs may override)
    notify: list[str] | None = None

    @field_validator("notify")
    @classmethod
    def _notify(cls, v: list[str] | None) -> list[str] | None:
        return _notify_argv(v)

    @field_validator("pct")
    @classmethod
    def _vmid(cls, v: int | None) -> int | None:
        if v is not None and not (VMID_MIN <= v <= VMID_MAX):
            raise ValueError(f"a Proxmox VMID is an integer in {VMID_MIN}..{VMID_MAX}, got {v}")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if any(g < 0 for g in v):
                raise ValueError("GPU indices are >= 0")
            if len(set(v)) != len(v):
                raise ValueError("GPU indices must be unique")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError("python must be one executable name or path, without whitespace")
        return v

    @model_validator(mode="after")
    def _reachability(self) -> HostConfig:
        if self.local and self.ssh is not None:
            raise ValueError("a host is either `local: true` or has `ssh:` settings, not both")
        if not self.local and self.ssh is None:
            raise ValueError("set `local: true` or give `ssh:` settings (at least `host:`)")
        return self

    @property
    def is_remote(self) -> bool:
        """Commands run somewhere else (over ssh, or inside a container even on this machine): paths are POSIX
        strings resolved there, `~` cannot be expanded here, and the interpreter is `python`, not ours."""
        return not self.local or self.pct is not None

    @property
    def kind(self) -> str:
        """`local`, `ssh`, `local+pct` or `ssh+pct`: which transport layers a command crosses."""
        base = "local" if self.local else "ssh"
        return f"{base}+pct" if self.pct is not None else base


class TauRegression(_Strict):
    """When the `tau_regression` alert (and its notify) fires: the latest tau of the run's in-training evaluation is
    below the best so far by more than max(drop_frac x best, drop_min). Defaults: the wrapper's TAU_DROP_*."""

    drop_frac: float = Field(TAU_DROP_FRAC, ge=0)
    drop_min: float = Field(TAU_DROP_MIN, ge=0)


class RunConfig(_Strict):
    """One training job on one host. After loading, every path here is absolute (see hosts.yaml for the rules)."""

    name: str
    workdir: str
    # argv list (no shell anywhere: each element arrives as one argument), or a string run as `bash -c STRING`
    # (then the string is bash code, by intent). An argv element exactly "{python}" becomes the host's interpreter.
    command: list[str] | str
    env: dict[str, EnvValue] = {}
    log: str
    events: str | None = None
    inductor_cache_dir: str | None = None
    # clear: the run's cache dir is emptied at every launch (a crashed compile once left broken artifacts);
    # keyed: kept while its key (torch/triton/python versions + code fingerprint) is unchanged.
    inductor_cache_policy: Literal["clear", "keyed"] = "clear"
    cache_key_paths: list[str] | None = None  # non-git workdirs: files/dirs hashed into the key (default: packages)
    checkpoint_dir: str | None = None  # where the run writes checkpoints (only used to refuse a cache dir above it)
    keep_logs: int = Field(10, ge=1)  # earlier attempts' logs kept as LOG.1 .. LOG.N (LOG.1 the latest)
    tmux_session: str | None = None
    state_dir: str | None = None
    model_dir: str | None = None
    model_manifest: str | None = None
    preflight: list[str] | None = None
    ready_pattern: str | None = None
    ready_timeout: float = Field(600.0, gt=0)
    stall_after: float | None = Field(None, gt=0)
    kill_grace: list[float] = [10.0, 10.0]
    clean_roots: list[str] | None = None
    restart: RestartPolicy = RestartPolicy()
    notify: list[str] | None = None  # default: the host's notify
    tau_regression: TauRegression = TauRegression()

    @field_validator("notify")
    @classmethod
    def _notify(cls, v: list[str] | None) -> list[str] | None:
        return _notify_argv(v)

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("command script is empty")
        elif not v or not v[0]:
            raise ValueError("command argv is empty")
        return v

    @field_validator("preflight")
    @classmethod
    def _preflight(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not v[0]):
            raise ValueError("preflight argv is empty")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not ENV_NAME_RE.match(k):
                raise ValueError(f"environment variable name {k!r} must match [A-Za-z_][A-Za-z0-9_]*")
            if "\x00" in val:
                raise ValueError(f"environment value of {k} contains a NUL byte")
        return v

    @field_validator("ready_pattern")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        return v

    @field_validator("kill_grace")
    @classmethod
    def _grace(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or any(x < 0 for x in v):
            raise ValueError("kill_grace is [seconds after SIGINT, seconds after SIGTERM], both >= 0")
        return v

    @field_validator("tmux_session")
    @classmethod
    def _session(cls, v: str | None) -> str | None:
        # tmux treats ':' and '.' in a target as window/pane separators; keep names unambiguous.
        if v is not None and (not v or any(c in v for c in ":.") or v.startswith("-") or "\n" in v):
            raise ValueError(f"tmux session name {v!r} must be non-empty, not start with '-', and contain no ':', '.', newline")
        return v

    @model_validator(mode="after")
    def _no_nul(self) -> RunConfig:
        # No exec or file system can carry a NUL byte; refuse it here rather than fail on the remote host.
        for key in ("workdir", "log", "events", "inductor_cache_dir", "tmux_session", "state_dir", "model_dir",
                    "model_manifest", "ready_pattern", "checkpoint_dir"):
            v = getattr(self, key)
            if isinstance(v, str) and "\x00" in v:
                raise ValueError(f"{key} contains a NUL byte")
        for key in ("command", "preflight"):
            v = getattr(self, key)
            if isinstance(v, list) and any("\x00" in a for a in v) or isinstance(v, str) and "\x00" in v:
                raise ValueError(f"{key} contains a NUL byte")
        return self

    @property
    def argv(self) -> list[str]:
        """The command as an argv list: a script string becomes ["bash", "-c", script]."""
        if isinstance(self.command, str):
            return ["bash", "-c", self.command]
        return list(self.command)


def default_tmux_session(run_name: str) -> str:
    """The tmux session of a run that sets no `tmux_session`: `dflash-NAME`, with each '.' as '_'.

    tmux reads '.' in a target as a window/pane separator, and a dotted name (`qwen3.6-27b`) is the natural name of
    such a run; the mapping is fixed so the session is found again on every later command."""
    return "dflash-" + run_name.replace(".", "_")


def _session_collisions(runs: dict[str, dict[str, RunConfig]], groups: dict[str, Any], file: str,
                        lines: dict[tuple[str, ...], int]) -> list[Problem]:
    """Two runs on one host whose sessions coincide only because a dotted name was mapped (`a.b` and `a_b`).

    Each run has its own tmux server, so nothing clashes on the host, but `tmux attach -t` and every message would
    name one session for two runs; the person who named them decides (tmux_session on one of them)."""
    problems: list[Problem] = []
    for hname, entries in _runs_on_hosts(runs, groups).items():
        seen: dict[str, tuple[tuple[str, ...], RunConfig]] = {}
        for loc, r in entries:
            session = r.tmux_session or ""
            first = seen.setdefault(session, (loc, r))
            if first[1] is r:
                continue
            mapped = [x for x in (first[1], r) if "." in x.name and session == default_tmux_session(x.name)]
            if mapped:
                problems.append(Problem(file, _line_for(lines, loc), ".".join(loc),
                                        f"run {r.name!r} and run {first[1].name!r} on host {hname} would share the "
                                        f"tmux session {session!r} ('.' in a run name becomes '_'); set "
                                        "tmux_session on one of them"))
    return problems


def _runs_on_hosts(runs: dict[str, dict[str, RunConfig]],
                   groups: dict[str, Any]) -> dict[str, list[tuple[tuple[str, ...], RunConfig]]]:
    """Every run a host carries, its own and its group nodes', with the hosts.yaml location of each."""
    on_host: dict[str, list[tuple[tuple[str, ...], RunConfig]]] = {}
    for hname, rs in runs.items():
        for rname, r in rs.items():
            on_host.setdefault(hname, []).append((("hosts", hname, "runs", rname), r))
    for gname, g in groups.items():
        for rname, gr in g.runs.items():
            for node in gr.nodes:
                on_host.setdefault(node.host.name, []).append((("groups", gname, "runs", rname), node.run))
    return on_host


def _shared_files(runs: dict[str, dict[str, RunConfig]], groups: dict[str, Any], file: str,
                  lines: dict[tuple[str, ...], int]) -> list[Problem]:
    """Two runs on one host writing one `log` or `events` file: each launch rotates the log (LOG -> LOG.1) from under
    the other run, and the events of both fold into one status (steps, losses and ends of the other run read as this
    one's). A run has its files; a second entry for the same training (other arguments) points at the same
    files only by mistake, since the second trainer is refused anyway (dflash's run lock)."""
    problems: list[Problem] = []
    for hname, entries in _runs_on_hosts(runs, groups).items():
        for key in ("log", "events"):
            seen: dict[str, tuple[tuple[str, ...], RunConfig]] = {}
            for loc, r in entries:
                path = getattr(r, key)
                if path is None:
                    continue
                first = seen.setdefault(posixpath.normpath(path), (loc, r))
                if first[1] is r:
                    continue
                problems.append(Problem(file, _line_for(lines, (*loc, key)) or _line_for(lines, loc),
                                        ".".join((*loc, key)),
                                        f"{path} is also the {key} file of run {first[1].name!r} on host {hname} "
                                        f"({'.'.join(first[0])}): give each run its own"))
    return problems


class _RunFile(RunConfig):
    name: str = ""  # taken from the mapping key


class _HostFile(HostConfig):
    name: str = ""
    runs: dict[str, _RunFile] = {}


class _InventoryFile(_Strict):
    hosts: dict[str, _HostFile]


class Inventory(BaseModel):
    """All hosts and their runs; `runs[host][run]`. Built only by load_inventory, which resolves every default."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # the file it came from (None: the embedded default)
    hosts: dict[str, HostConfig]
    runs: dict[str, dict[str, RunConfig]]
    groups: dict[str, Any] = {}  # name -> opsctl.group.Group (one run across several hosts; validated there)


# ---------------------------------------------------------------------------------------------------------------
# YAML with line numbers


def _parse_yaml(text: str, file: str) -> tuple[Any, dict[tuple[str, ...], int]]:
    """hosts.yaml through the YAML reader dflash's run configs use too: YAML 1.2 numbers (`1e3`), the line of every
    key, duplicate keys refused, syntax errors at the line to fix."""
    try:
        doc = yamlfile.parse(text, file)
    except yamlfile.YamlFileError as e:
        raise InventoryError([Problem(file, *p) for p in e.problems]) from None
    return doc.data, doc.lines


def _line_for(lines: dict[tuple[str, ...], int], loc: tuple[str, ...]) -> int | None:
    return yamlfile.line_for(lines, loc)


def _problems_from(err: ValidationError, lines: dict[tuple[str, ...], int], file: str) -> list[Problem]:
    out: list[Problem] = []
    for e in err.errors():
        # pydantic adds the union member name ("list[str]", "str") to the location; hide it from people.
        loc = tuple(str(p) for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float"))))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown key '{loc[-1]}'" + _suggest_key(loc, lines)
        elif e["type"] == "missing":
            msg = f"missing required field '{loc[-1]}'"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        prob = Problem(file, _line_for(lines, loc), ".".join(loc), msg)
        if out and out[-1].field == prob.field and e["type"] in ("list_type", "string_type"):
            # one union field (command: argv list | script string) failing both ways: say it once.
            out[-1] = prob._replace(message="expected an argv list of strings or a script string")
            continue
        out.append(prob)
    return out


_ALL_KEYS = (set(SSHSettings.model_fields) | set(_HostFile.model_fields) | set(RunConfig.model_fields)
             | set(RestartPolicy.model_fields) | {"hosts", "groups"})


# Where each known key belongs, for a key written at the wrong level (`workdir:` under a host, not a run).
_KEY_HOMES = (("a run (under `runs: NAME:`)", set(RunConfig.model_fields)),
              ("a host (under `hosts: NAME:`)", set(_HostFile.model_fields)),
              ("a host's `ssh:`", set(SSHSettings.model_fields)),
              ("a run's `restart:`", set(RestartPolicy.model_fields)))


def _suggest_key(loc: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> str:
    key = loc[-1]
    if len(loc) == 1:  # the top level holds hosts, groups and x- keys: `host:` is `hosts:` misspelt, not ssh's key
        close = difflib.get_close_matches(key, ["hosts", "groups"], n=1, cutoff=0.75)
        if close:
            return f" (did you mean '{close[0]}'?)"
    homes = [where for where, keys in _KEY_HOMES if key in keys and key != "name"]
    if homes:  # a real key at the wrong level: say where it goes, not "did you mean" itself
        return f" here: '{key}' belongs to {' or '.join(homes)}; check its indentation"
    close = difflib.get_close_matches(key, sorted(_ALL_KEYS - {"name"}), n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ---------------------------------------------------------------------------------------------------------------
# defaults and path resolution


def _resolve_local_path(p: str, base: Path) -> str:
    q = Path(p).expanduser()
    return str(q if q.is_absolute() else (base / q).resolve())


def _finish_run(run: RunConfig, host: HostConfig, base_dir: Path, file: str, loc: tuple[str, ...],
                lines: dict[tuple[str, ...], int]) -> RunConfig:
    """Resolve relative paths and computed defaults, so every consumer sees the same absolute values."""
    problems: list[Problem] = []

    def bad(field: str, msg: str) -> None:
        problems.append(Problem(file, _line_for(lines, (*loc, field)), ".".join((*loc, field)), msg))

    data = run.model_dump()
    if not host.is_remote:
        workdir = _resolve_local_path(run.workdir, base_dir)
    else:
        workdir = run.workdir
        if not posixpath.isabs(workdir):
            bad("workdir", f"{workdir!r}: a remote (ssh or pct) workdir must be an absolute path")
            workdir = posixpath.join("/", workdir)
        workdir = posixpath.normpath(workdir)
    data["workdir"] = workdir

    def under_workdir(p: str | None) -> str | None:
        if p is None:
            return None
        if not host.is_remote:
            return _resolve_local_path(p, Path(workdir))
        return posixpath.normpath(posixpath.join(workdir, p))

    remote = host.is_remote
    for key in ("log", "events", "state_dir", "model_dir", "inductor_cache_dir", "model_manifest"):
        if remote and isinstance(data[key], str) and data[key].startswith("~"):
            bad(key, f"{data[key]!r}: '~' cannot be resolved for a remote host; write an absolute path")
    for key in ("log", "events", "state_dir", "model_dir", "inductor_cache_dir", "checkpoint_dir"):
        data[key] = under_workdir(data[key])
    if data["model_manifest"] is not None:
        base = data["model_dir"] or workdir
        data["model_manifest"] = (
            _resolve_local_path(data["model_manifest"], Path(base)) if not host.is_remote
            else posixpath.normpath(posixpath.join(base, data["model_manifest"]))
        )
    if data["tmux_session"] is None:
        data["tmux_session"] = default_tmux_session(run.name)
    if data["state_dir"] is None:
        data["state_dir"] = posixpath.join(workdir, ".opsctl", run.name)
    if data["inductor_cache_dir"] is None:
        # Per run, never torch's shared /tmp/torchinductor_<user>: clearing that one at launch would pull the
        # cache from under every other live run (and torch job) of the user on the host.
        env_dir = run.env.get("TORCHINDUCTOR_CACHE_DIR")
        data["inductor_cache_dir"] = under_workdir(env_dir) if env_dir else posixpath.join(data["state_dir"], "inductor")
    explicit_roots = data["clean_roots"] is not None
    if not explicit_roots:
        data["clean_roots"] = [data["inductor_cache_dir"]]
    for i, root in enumerate(data["clean_roots"] if explicit_roots else []):
        why = dangerous_path_reason(root)
        if why:
            problems.append(Problem(file, _line_for(lines, (*loc, "clean_roots", str(i))), ".".join((*loc, "clean_roots", str(i))),
                             f"refusing clean root: {why}"))
    cache = data["inductor_cache_dir"]
    why = dangerous_path_reason(cache)
    raw_cache = run.inductor_cache_dir
    if raw_cache is not None and raw_cache.strip() in ("", ".", "./"):
        # "" and "." resolve to the workdir: emptying it would delete the sources and the run's state.
        bad("inductor_cache_dir", f"refusing inductor cache dir {raw_cache!r} (it is emptied by launch/clean): "
                                  f"it resolves to the workdir {workdir!r}; name a dedicated directory")
    elif why:
        bad("inductor_cache_dir", f"refusing inductor cache dir (it is emptied by launch/clean): {why}")
    elif (hit := cache_overlap(cache, protected_paths(data))) is not None:
        bad("inductor_cache_dir", f"refusing inductor cache dir {cache!r} (it is emptied by launch/clean): "
                                  f"it is or contains the run's {hit[0]} {hit[1]!r}")
    elif not any(path_is_within(cache, r) for r in data["clean_roots"]):
        bad("inductor_cache_dir", f"{cache!r} is not inside any of clean_roots {data['clean_roots']}")
    if data["notify"] is None:
        data["notify"] = host.notify
    if isinstance(run.command, list):
        python = host.python if host.is_remote else sys.executable
        data["command"] = [python if a == PYTHON_PLACEHOLDER else a for a in run.command]
    if problems:
        raise InventoryError(problems)
    data.pop("runs", None)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:  # a computed value broke a rule: still one FILE:LINE problem, never a traceback
        sub = {k[len(loc):]: v for k, v in lines.items() if k[:len(loc)] == loc}
        raise InventoryError([p._replace(field=".".join((*loc, p.field)), line=p.line or _line_for(lines, loc))
                              for p in _problems_from(e, sub, file)]) from None


def _finish_host(h: _HostFile, file: str, base_dir: Path) -> HostConfig:
    data = h.model_dump(exclude={"runs"})
    if h.ssh is not None:
        for key in ("identity_file", "known_hosts"):
            if data["ssh"][key] is not None:
                data["ssh"][key] = _resolve_local_path(data["ssh"][key], base_dir)
    return HostConfig.model_validate(data)


# ---------------------------------------------------------------------------------------------------------------
# public entry points


# Top-level keys with this prefix are left out of validation (Docker Compose's extension fields): somewhere to put
# YAML anchors that hosts and runs share, e.g. `x-run-defaults: &d {workdir: /srv/dflash}` then `<<: *d` in a run.
EXTENSION_PREFIX = "x-"


def parse_inventory(text: str, file: str = DEFAULT_HOSTS_FILE, base_dir: str | Path | None = None) -> Inventory:
    """Validate hosts.yaml text; `file` is the name used in messages, `base_dir` anchors relative paths."""
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    raw, lines = _parse_yaml(text, file)
    if not isinstance(raw, dict):
        raise InventoryError([Problem(file, 1, "", "the top level must be a mapping with a `hosts:` key")])
    for key in [k for k in raw if isinstance(k, str) and k.startswith(EXTENSION_PREFIX)]:
        del raw[key]  # `x-defaults: &d {...}`: a place for anchors that runs merge with `<<: *d`
    groups_raw = raw.pop("groups", None)  # opsctl.group validates them once the hosts are known
    hosts_raw = raw.get("hosts")
    problems: list[Problem] = []
    if isinstance(hosts_raw, dict):
        for hname in list(hosts_raw):
            # an alias (`b: *a`) makes two entries one dict: each gets its own copy before its name is set in it
            hval = hosts_raw[hname] = dict(hosts_raw[hname]) if isinstance(hosts_raw[hname], dict) else hosts_raw[hname]
            if not isinstance(hname, str) or not NAME_RE.match(hname):
                problems.append(Problem(file, _line_for(lines, ("hosts", str(hname))), f"hosts.{hname}",
                                 "host names use letters, digits, '_', '.', '-' and start with a letter or digit"))
            if isinstance(hval, dict):
                for key in ("name",):
                    if key in hval:
                        problems.append(Problem(file, _line_for(lines, ("hosts", str(hname), key)), f"hosts.{hname}.{key}",
                                         "the name is the mapping key; remove this field"))
                hval["name"] = str(hname)
                runs = hval.get("runs")
                if isinstance(runs, dict):
                    runs = hval["runs"] = {k: dict(v) if isinstance(v, dict) else v for k, v in runs.items()}
                    for rname, rval in runs.items():
                        if not isinstance(rname, str) or not NAME_RE.match(rname):
                            problems.append(Problem(file, _line_for(lines, ("hosts", str(hname), "runs", str(rname))),
                                             f"hosts.{hname}.runs.{rname}",
                                             "run names use letters, digits, '_', '.', '-' and start with a letter or digit"))
                        if isinstance(rval, dict):
                            if "name" in rval:
                                problems.append(Problem(file, _line_for(lines, ("hosts", str(hname), "runs", str(rname), "name")),
                                                 f"hosts.{hname}.runs.{rname}.name",
                                                 "the name is the mapping key; remove this field"))
                            rval["name"] = str(rname)
    if problems:
        raise InventoryError(problems)
    try:
        parsed = _InventoryFile.model_validate(raw)
    except ValidationError as e:
        raise InventoryError(_problems_from(e, lines, file)) from None

    hosts: dict[str, HostConfig] = {}
    runs: dict[str, dict[str, RunConfig]] = {}
    for hname, h in parsed.hosts.items():
        host = _finish_host(h, file, base)
        if host.ssh is not None and host.ssh.jump is not None and host.ssh.jump in parsed.hosts:
            jh = parsed.hosts[host.ssh.jump]
            if jh.ssh is None or jh.name == hname:
                problems.append(Problem(file, _line_for(lines, ("hosts", hname, "ssh", "jump")), f"hosts.{hname}.ssh.jump",
                                 f"jump host {host.ssh.jump!r} must be another host with `ssh:` settings"))
        hosts[hname] = host
        runs[hname] = {}
        for rname, r in h.runs.items():
            try:
                runs[hname][rname] = _finish_run(r, host, base, file, ("hosts", hname, "runs", rname), lines)
            except InventoryError as e:
                problems.extend(e.problems)
    if problems:
        raise InventoryError(problems)
    try:
        groups = parse_groups(groups_raw, hosts, _group_checks(file, base, lines))
    except GroupProblems as e:
        raise InventoryError(e.problems) from None
    problems = _session_collisions(runs, groups, file, lines) + _shared_files(runs, groups, file, lines)
    if problems:
        raise InventoryError(problems)
    return Inventory(path=None, hosts=hosts, runs=runs, groups=groups)


def _group_checks(file: str, base: Path, lines: dict[tuple[str, ...], int]) -> Checks:
    """This loader's checks, lent to opsctl.group: a group run's node runs are checked as a host's runs are."""

    def problem(loc: tuple[str, ...], msg: str) -> Problem:
        return Problem(file, _line_for(lines, loc), ".".join(loc), msg)

    def from_validation(err: ValidationError, loc: tuple[str, ...]) -> list[Problem]:
        sub = {k[len(loc):]: v for k, v in lines.items() if k[:len(loc)] == loc}
        return [p._replace(field=".".join((*loc, p.field)) if p.field else ".".join(loc),
                           line=p.line if p.line is not None else _line_for(lines, loc))
                for p in _problems_from(err, sub, file)]

    def finish(data: dict[str, Any], host: HostConfig, loc: tuple[str, ...]) -> RunConfig:
        try:
            run = RunConfig.model_validate(data)
        except ValidationError as e:
            raise InventoryError(from_validation(e, loc)) from None
        return _finish_run(run, host, base, file, loc, lines)

    return Checks(problem, from_validation, finish)


def default_inventory_path() -> Path | None:
    """$OPSCTL_HOSTS if set, else ./hosts.yaml if it exists, else None (the embedded default)."""
    env = os.environ.get(ENV_HOSTS_FILE)
    if env:
        return Path(env)
    p = Path(DEFAULT_HOSTS_FILE)
    return p if p.is_file() else None


def load_inventory(path: str | Path | None = None) -> Inventory:
    """Load and validate an inventory. None: $OPSCTL_HOSTS, else ./hosts.yaml, else the embedded default.

    Relative paths in the file resolve against the file's directory (workdir) and then the workdir (the rest).
    """
    p = Path(path) if path is not None else default_inventory_path()
    if p is None:
        inv = parse_inventory(default_hosts_yaml(), file="<embedded default hosts.yaml>", base_dir=Path.cwd())
        return inv
    shown = str(path) if path is not None else str(p)
    try:
        text = yamlfile.decode(yamlfile.read_bytes(p, shown), shown)  # refused past yamlfile.MAX_CONFIG_BYTES
    except FileNotFoundError:
        raise InventoryError([Problem(shown, None, "", "file not found")]) from None
    except yamlfile.YamlFileError as e:
        raise InventoryError([Problem(shown, *pr) for pr in e.problems]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InventoryError([Problem(shown, None, "", f"cannot read: {e}")]) from None
    inv = parse_inventory(text, file=shown, base_dir=p.resolve().parent)
    inv.path = str(p.resolve())
    return inv


def check_inventory(path: str | Path | None = None) -> list[str]:
    """Every problem in the inventory as one line each (empty list: valid). For `opsctl hosts check`."""
    try:
        load_inventory(path)
    except InventoryError as e:
        return [_format_problem(*p) for p in e.problems]
    return []


def _unknown(kind: str, name: str, known: list[str], where: str = "") -> InventoryError:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    listing = ", ".join(sorted(known)) if known else "none"
    return InventoryError([Problem("hosts.yaml" if not where else where, None, "", f"unknown {kind} '{name}'{hint}; known {kind}s: {listing}")])


def resolve(inv: Inventory, host: str, run: str | None) -> tuple[HostConfig, RunConfig | None]:
    """Look up HOST [RUN] as typed on the command line; a typo gets the closest known name suggested."""
    where = inv.path or "hosts.yaml"
    if host not in inv.hosts:
        raise _unknown("host", host, list(inv.hosts), where)
    h = inv.hosts[host]
    if run is None:
        return h, None
    runs = inv.runs.get(host, {})
    if run not in runs:
        err = _unknown("run", run, list(runs), where)
        err.problems = [p._replace(field=f"hosts.{host}.runs") for p in err.problems]
        err.args = ("\n".join(_format_problem(*p) for p in err.problems),)
        raise err
    return h, runs[run]
