"""Groups: one training run across several hosts through torchrun's c10d rendezvous, handled as one run by opsctl.

hosts.yaml `groups:` is validated here (members, head, port, GPUs); every verb on a group works through the per-host verbs.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# hosts.yaml's names (config.NAME_RE spells the same rule for hosts and runs; this module sits below config)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

NODE_PLACEHOLDER = "{node}"  # in a group run's paths and command: the node rank (members sharing a file system)
# torchrun itself, except that the head keeps the c10d store up until every node has left (dflash/torchrun.py).
TORCHRUN = ["{python}", "-m", "dflash.torchrun"]
# The launcher options opsctl computes for every node: given by hand they would disagree between nodes.
FILLED_OPTIONS = ("--nnodes", "--node-rank", "--node_rank", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend",
                  "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf",
                  "--rdzv_conf", "--local-addr", "--local_addr", "--master-addr", "--master_addr", "--master-port",
                  "--master_port", "--standalone")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Launcher(_Strict):
    """The keys a group run has beyond a host's run: how torchrun starts it on every node."""

    nproc_per_node: int | None = Field(None, ge=1)  # default: the members' GPU count (their `gpus:` lists)
    torchrun: list[str] = TORCHRUN  # the launcher argv; opsctl appends the rendezvous options, then `command`
    max_restarts: int = Field(0, ge=0)  # torchrun's own in-place restarts of a node's workers

    @field_validator("torchrun")
    @classmethod
    def _launcher(cls, v: list[str]) -> list[str]:
        if not v or not v[0] or any("\x00" in a for a in v):
            raise ValueError("torchrun is an argv list, e.g. ['{python}', -m, dflash.torchrun]")
        return v


LAUNCHER_KEYS = tuple(Launcher.model_fields)


class Checks:
    """What hosts.yaml's loader (opsctl.config) lends this module, so that a group run's node runs pass exactly the
    checks of a host's run, and every problem is one of its FILE:LINE problems."""

    def __init__(self, problem: Callable[[tuple[str, ...], str], Any],
                 from_validation: Callable[[ValidationError, tuple[str, ...]], list[Any]],
                 finish: Callable[[dict[str, Any], Any, tuple[str, ...]], Any]) -> None:
        self.problem = problem  # (location, message) -> a Problem
        self.from_validation = from_validation  # pydantic's errors at a location -> Problems
        self.finish = finish  # (run mapping, host, location) -> the node's RunConfig; raises with .problems


class GroupFile(_Strict):
    """A named set of hosts that run one job together; node i of the job is `members[i]`."""

    members: list[str]
    head: str | None = None  # the member that hosts the rendezvous store (default: the first)
    port: int = Field(29400, ge=1, le=65535)  # the rendezvous port on the head
    # where the other nodes reach the head, and where each node's workers listen (default: the member's ssh host)
    addresses: dict[str, str] = {}
    runs: dict[str, dict[str, Any]] = {}  # each a host run's keys plus Launcher's

    @field_validator("members")
    @classmethod
    def _members(cls, v: list[str]) -> list[str]:
        if len(v) < 1:
            raise ValueError("a group needs at least one member host")
        dup = sorted({m for m in v if v.count(m) > 1})
        if dup:
            raise ValueError(f"member listed twice: {', '.join(dup)} (one node per host)")
        return v

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, v: dict[str, str]) -> dict[str, str]:
        for k, a in v.items():
            if not a or any(c.isspace() for c in a) or a.startswith("-"):
                raise ValueError(f"address of {k} must be one host name or IP, got {a!r}")
        return v


@dataclass(frozen=True)
class Node:
    """One member's share of a group run: a normal run on its host, whose command is the torchrun line."""

    index: int
    host: Any  # opsctl.config.HostConfig
    run: Any  # opsctl.config.RunConfig: its command is the node's torchrun line
    address: str


@dataclass(frozen=True)
class GroupRun:
    group: str
    name: str
    nodes: list[Node]
    nproc_per_node: int
    head: str  # HEAD:PORT as every node's --rdzv-endpoint says it
    ready_timeout: float
    # The group's restart policy (opsctl.config.RestartPolicy; None: never). The nodes' own runs carry none: a
    # node's wrapper would restart its node alone, so the opsctl that follows the group restarts it as a whole.
    restart: Any = None

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node

    def ranks(self, node: int) -> range:
        """The global ranks of node `node` (torchrun numbers them node by node)."""
        return range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node)


@dataclass(frozen=True)
class Group:
    name: str
    members: list[str]
    head: str
    port: int
    runs: dict[str, GroupRun]


def _address(host: Any, addresses: dict[str, str]) -> str:
    if host.name in addresses:
        return addresses[host.name]
    if host.ssh is not None:
        return host.ssh.host
    return "127.0.0.1"


def _subst(v: Any, node: int) -> Any:
    if isinstance(v, str):
        return v.replace(NODE_PLACEHOLDER, str(node))
    if isinstance(v, list):
        return [_subst(x, node) for x in v]
    return v


def node_command(launcher: list[str], g: str, r: str, n_nodes: int, i: int, nproc: int, endpoint: str,
                 address: str, max_restarts: int, command: list[str]) -> list[str]:
    """`torchrun --nnodes N --node-rank i ... COMMAND`: the one line that differs between nodes only in i and the
    node's own address. The head hosts the c10d store (is_host), so two members on one machine never both try."""
    return [*launcher, "--nnodes", str(n_nodes), "--node-rank", str(i), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"{g}-{r}",
            "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}", "--local-addr", address,
            "--max-restarts", str(max_restarts), *command]


def parse_groups(raw: Any, hosts: dict[str, Any], checks: Checks) -> dict[str, Group]:
    """hosts.yaml `groups:` -> Group objects whose node runs went through the same checks as a host's runs.

    Raises the loader's error (InventoryError: FILE:LINE problems, like the rest of the file)."""
    if raw is None:
        return {}
    problem = checks.problem
    if not isinstance(raw, dict):
        raise GroupProblems([problem(("groups",), "groups is a mapping of group name -> {members, runs, ...}")])
    problems: list[Any] = []
    out: dict[str, Group] = {}
    for gname, graw in raw.items():
        gloc = ("groups", str(gname))
        before = len(problems)
        if not isinstance(gname, str) or not NAME_RE.match(gname):
            problems.append(problem(gloc, "group names use letters, digits, '_', '.', '-' and start with a letter "
                                          "or digit"))
            continue
        if gname in hosts:
            problems.append(problem(gloc, f"'{gname}' is also a host name; a group needs a name of its own"))
            continue
        try:
            gf = GroupFile.model_validate(graw)
        except ValidationError as e:
            problems += checks.from_validation(e, gloc)
            continue
        unknown = [m for m in gf.members if m not in hosts]
        for m in unknown:
            close = difflib.get_close_matches(m, list(hosts), n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(problem((*gloc, "members"), f"unknown host '{m}'{hint}; known hosts: "
                                                        f"{', '.join(sorted(hosts)) or 'none'}"))
        for a in gf.addresses:
            if a not in gf.members:
                problems.append(problem((*gloc, "addresses", a), f"'{a}' is not a member of the group"))
        if gf.head is not None and gf.head not in gf.members:
            problems.append(problem((*gloc, "head"), f"head '{gf.head}' is not a member ({', '.join(gf.members)})"))
        if len(problems) > before:
            continue
        # The head is node 0: torchrun's c10d store runs in its agent, and global rank 0 lives there.
        head = gf.head or gf.members[0]
        members = [head, *[m for m in gf.members if m != head]]
        mhosts = [hosts[m] for m in members]
        endpoint = f"{_address(hosts[head], gf.addresses)}:{gf.port}"
        runs: dict[str, GroupRun] = {}
        for rname, rraw in gf.runs.items():
            rloc = (*gloc, "runs", rname)
            if not NAME_RE.match(rname):
                problems.append(problem(rloc, "run names use letters, digits, '_', '.', '-' and start with a "
                                              "letter or digit"))
                continue
            if not isinstance(rraw, dict):
                problems.append(problem(rloc, "a group run is a mapping (workdir, command, log, ...)"))
                continue
            if "name" in rraw:
                problems.append(problem((*rloc, "name"), "the name is the mapping key; remove this field"))
                continue
            try:
                launcher = Launcher.model_validate({k: rraw[k] for k in LAUNCHER_KEYS if k in rraw})
            except ValidationError as e:
                problems += checks.from_validation(e, rloc)
                continue
            data = {k: v for k, v in rraw.items() if k not in LAUNCHER_KEYS}
            nproc, why = _nproc(launcher.nproc_per_node, mhosts)
            if why:
                problems.append(problem((*rloc, "nproc_per_node"), why))
                continue
            command = data.get("command")
            if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
                problems.append(problem((*rloc, "command"), "a group run's command is an argv list (the script "
                                        "torchrun starts and its arguments, e.g. [-m, dflash, train, ...])"))
                continue
            filled = [a for a in [*command, *launcher.torchrun] if a.split("=")[0] in FILLED_OPTIONS]
            if filled:
                problems.append(problem((*rloc, "command"), f"{', '.join(filled)}: opsctl fills these for every "
                                        "node (node rank, head address and port from the group); remove them"))
                continue
            nodes: list[Node] = []
            for i, h in enumerate(mhosts):
                node_data = {k: _subst(v, i) for k, v in data.items()}
                node_data["name"] = f"{gname}-{rname}-node{i}"
                addr = _address(h, gf.addresses)
                node_data["command"] = node_command(_subst(launcher.torchrun, i), gname, rname, len(mhosts), i,
                                                    nproc, endpoint, addr, launcher.max_restarts,
                                                    node_data["command"])
                try:
                    run = checks.finish(node_data, h, rloc)
                except Exception as e:  # the loader's error: its problems, said for this member
                    if not hasattr(e, "problems"):
                        raise
                    problems += [p._replace(message=f"on member {h.name}: {p.message}") for p in e.problems]
                    break
                nodes.append(Node(i, h, run, addr))
            else:
                policy = nodes[0].run.restart
                # Validated with the node runs (same rules, same FILE:LINE errors), then taken off them: the group
                # is restarted as a whole by the opsctl that follows it, never one node by its wrapper.
                nodes = [dataclasses.replace(n, run=n.run.model_copy(update={"restart": type(policy)()}))
                         for n in nodes]
                runs[rname] = GroupRun(gname, rname, nodes, nproc, endpoint, float(run.ready_timeout),
                                       policy if policy.when != "never" else None)
        out[gname] = Group(gname, members, head, gf.port, runs)
    if problems:
        raise GroupProblems(problems)
    return out


class GroupProblems(Exception):
    """Problems found here; the loader turns them into its own error (one FILE:LINE line each)."""

    def __init__(self, problems: list[Any]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def _nproc(given: int | None, hosts: list[Any]) -> tuple[int, str | None]:
    """Processes per node: given, or the members' GPU count; a member with fewer listed GPUs is an error."""
    counts = {h.name: len(h.gpus) for h in hosts if h.gpus is not None}
    if given is None:
        if not counts or len(counts) != len(hosts):
            return 0, ("set nproc_per_node (processes per node), or list `gpus:` on every member "
                       f"(missing on {', '.join(h.name for h in hosts if h.gpus is None)})")
        if len(set(counts.values())) != 1:
            return 0, ("members list different GPU counts (" + ", ".join(f"{k}: {v}" for k, v in counts.items())
                       + "); every node runs the same number of ranks: set nproc_per_node")
        return next(iter(counts.values())), None
    short = {k: v for k, v in counts.items() if v < given}
    if short:
        return 0, (f"{given} processes per node, but " + ", ".join(f"{k} lists {v} GPU(s)" for k, v in short.items()))
    return given, None


# -- the group's own state, from its nodes' states (status, watch) ---------------------------------------------
RUNNING = ("starting", "loading", "compiling", "training", "stalled", "restarting")
PROGRESS = ("starting", "loading", "compiling", "training")  # a group is as far as its slowest node
# A rank that lost its peer fails with one of these: it is a follower of the crash, not its cause.
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|DistNetworkError|DistStoreError|"
                       r"remote process exited|NCCL communicator was aborted|Socket Timeout|RendezvousClosed",
                       re.I)


def rankless(row: dict[str, Any]) -> dict[str, Any]:
    """A node without global rank 0 never sees run_start or phase events (rank 0 writes them); its ranks say
    their phase in heartbeats only. While its process runs, that phase is its state, not `starting`."""
    if row["node"] > 0 and row["state"] == "starting" and row.get("proc_state") == "running" and row.get("phase"):
        phase = row["phase"]
        # the periodic phases of training (a checkpoint, an in-training evaluation) are training, as on node 0
        row["state"] = "training" if phase in ("training", "saving", "evaluating") else (
            "compiling" if phase == "compiling" else "loading")
    return row


def verdict(rows: list[dict[str, Any]]) -> tuple[str, str | None, int | None]:
    """(group state, why, the node it is about) from one row per node in node order (`node`, `host`, `state`, and
    where known `reason`, `exception`, `started_at`, `duration_s`): crashed names the node whose failure came first
    and is not a peer's lost connection; training only when every node trains."""
    def name(r: dict[str, Any]) -> str:
        return f"node{r['node']} {r['host']}"

    states = [r["state"] for r in rows]
    crashed = [r for r in rows if r["state"] == "crashed"]
    if crashed:
        def end(r: dict[str, Any]) -> float:
            return (r.get("started_at") or 0.0) + (r.get("duration_s") or 0.0)

        def follower(r: dict[str, Any]) -> bool:
            return bool(PEER_LOST.search(" ".join(str(r.get(k) or "") for k in ("reason", "exception"))))

        first = sorted(crashed, key=lambda r: (follower(r), end(r)))[0]
        running = [name(r) for r in rows if r["state"] in RUNNING]
        why = f"{name(first)}: {first.get('reason') or 'crashed'}"
        if running:
            why += f"; still running: {', '.join(running)}"
        return "crashed", why, first["node"]
    refused = [r for r in rows if r["state"] == "refused"]
    if refused:  # a node that refused to start stops the group as a crash does, and is never restarted
        first = refused[0]
        running = [name(r) for r in rows if r["state"] in RUNNING]
        why = f"{name(first)}: {first.get('reason') or 'refused'}"
        if running:
            why += f"; still running: {', '.join(running)}"
        return "refused", why, first["node"]
    unreachable = [r for r in rows if r["state"] == "unreachable"]
    if unreachable:
        return "unreachable", ", ".join(name(r) for r in unreachable), unreachable[0]["node"]
    if all(s == "absent" for s in states):
        return "absent", None, None
    running = [s for s in states if s in RUNNING]
    if running and len(running) < len(states):
        gone = [r for r in rows if r["state"] not in RUNNING]
        return "degraded", ", ".join(f"{name(r)} {r['state']}" for r in gone), gone[0]["node"]
    if running:
        for s in ("stalled", "restarting"):
            if s in states:
                return s, None, rows[states.index(s)]["node"]
        slowest = min(states, key=lambda s: PROGRESS.index(s) if s in PROGRESS else 0)
        return slowest, None, None
    if all(s == "finished" for s in states):
        return "finished", None, None
    if "killed" in states:
        return "killed", None, None
    return states[0], None, None
