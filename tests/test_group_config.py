"""hosts.yaml `groups:`: members, head, port, GPU counts and the torchrun line opsctl builds for every node.

Every mistake is one FILE:LINE: field: message line, like the rest of hosts.yaml; a valid group's node commands
differ only in the node rank, the rendezvous role and the node's own address.
"""

from __future__ import annotations

import textwrap

import pytest

from opsctl.config import InventoryError, parse_inventory

HOSTS = textwrap.dedent("""\
    hosts:
      a:
        ssh: {host: 10.0.0.1}
        gpus: [0, 1, 2, 3]
      b:
        ssh: {host: 10.0.0.2}
        gpus: [0, 1, 2, 3]
      c:
        ssh: {host: 10.0.0.3}
        pct: 200
        gpus: [0, 1]
    """)


def group(body: str) -> str:
    return HOSTS + "groups:\n" + textwrap.indent(textwrap.dedent(body), "  ")


PAIR = """\
    pair:
      members: [a, b]
      port: 29500
      runs:
        big:
          workdir: /srv/w
          command: [-m, dflash, train, --config, configs/x.yaml, --out, "runs/big-{node}"]
          log: "runs/big-{node}/train.log"
          events: "runs/big-{node}/events.jsonl"
          env: {NCCL_SOCKET_IFNAME: eth0}
    """


def errors_of(text: str) -> list[str]:
    with pytest.raises(InventoryError) as ei:
        parse_inventory(text, file="hosts.yaml", base_dir="/srv/x")
    return str(ei.value).splitlines()


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_a_group_run_becomes_one_torchrun_per_member_with_node_rank_head_and_port_filled() -> None:
    inv = parse_inventory(group(PAIR), file="hosts.yaml", base_dir="/srv/x")
    run = inv.groups["pair"].runs["big"]
    assert run.nproc_per_node == 4 and run.world_size == 8 and run.head == "10.0.0.1:29500"
    assert [n.host.name for n in run.nodes] == ["a", "b"]
    assert list(run.ranks(1)) == [4, 5, 6, 7]
    cmds = [n.run.command for n in run.nodes]
    assert cmds[0][:3] == ["python3", "-m", "dflash.torchrun"]
    for i, cmd in enumerate(cmds):
        opts = dict(zip(cmd[3:-7:2], cmd[4:-7:2], strict=True))
        assert opts == {"--nnodes": "2", "--node-rank": str(i), "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                        "--rdzv-endpoint": "10.0.0.1:29500", "--rdzv-id": "pair-big",
                        "--rdzv-conf": f"is_host={'true' if i == 0 else 'false'}",
                        "--local-addr": f"10.0.0.{i + 1}", "--max-restarts": "0"}
        assert cmd[-7:] == ["-m", "dflash", "train", "--config", "configs/x.yaml", "--out", f"runs/big-{i}"]
    # Each node is a normal run on its host: its own name, state dir and tmux session; {node} in its paths.
    n1 = run.nodes[1].run
    assert (n1.name, n1.tmux_session, n1.state_dir) == ("pair-big-node1", "dflash-pair-big-node1",
                                                        "/srv/w/.opsctl/pair-big-node1")
    assert (n1.log, n1.events, n1.env) == ("/srv/w/runs/big-1/train.log", "/srv/w/runs/big-1/events.jsonl",
                                           {"NCCL_SOCKET_IFNAME": "eth0"})


def test_head_is_node_zero_and_addresses_override_the_ssh_host() -> None:
    text = group(PAIR.replace("port: 29500", "head: b\n      addresses: {b: 192.168.1.2, a: 192.168.1.1}"))
    run = parse_inventory(text, file="hosts.yaml", base_dir="/srv/x").groups["pair"].runs["big"]
    assert [n.host.name for n in run.nodes] == ["b", "a"]
    assert run.head == "192.168.1.2:29400"  # the default rendezvous port
    assert run.nodes[1].run.command[run.nodes[1].run.command.index("--local-addr") + 1] == "192.168.1.1"


@pytest.mark.parametrize(("edit", "needle", "message"), [
    (("members: [a, b]", "members: [a, bb]"), "members:", "groups.pair.members: unknown host 'bb' (did you mean 'b'?)"),
    (("members: [a, b]", "members: [a, a]"), "members:", "groups.pair.members: member listed twice: a"),
    (("port: 29500", "port: 70000"), "port:", "groups.pair.port: Input should be less than or equal to 65535"),
    (("port: 29500", "head: c"), "head:", "groups.pair.head: head 'c' is not a member (a, b)"),
    (("port: 29500", "prot: 1"), "prot:", "groups.pair.prot: unknown key 'prot' (did you mean 'port'?)"),
    (("members: [a, b]", "members: [a, c]"), "big:",
     "groups.pair.runs.big.nproc_per_node: members list different GPU counts (a: 4, c: 2)"),
    (("workdir: /srv/w", "workdir: /srv/w\n          nproc_per_node: 8"), "nproc_per_node:", None),
    (("train, --config", "train, --nnodes, '3', --config"), "command:",
     "groups.pair.runs.big.command: --nnodes: opsctl fills these for every node"),
    (("workdir: /srv/w", "workdir: /srv/w\n          restart: {when: on-failure, max: 0}"), "restart:",
     "groups.pair.runs.big.restart.max: on member a: Input should be greater than or equal to 1"),
    (("workdir: /srv/w", "workdir: srv/w"), "workdir:",
     "groups.pair.runs.big.workdir: on member a: 'srv/w': a remote (ssh or pct) workdir must be an absolute path"),
])
def test_group_mistakes_are_reported_at_their_line(edit: tuple[str, str], needle: str, message: str | None) -> None:
    text = group(PAIR.replace(*edit))
    errs = errors_of(text)
    if message is None:  # the nproc_per_node case: 8 ranks per node on members that list 4 GPUs
        assert any("nproc_per_node: 8 processes per node, but a lists 4 GPU(s), b lists 4 GPU(s)" in e
                   for e in errs), errs
        return
    assert any(e.startswith(f"hosts.yaml:{line_of(text, needle)}: {message}") for e in errs), errs


def test_group_named_like_a_host_and_gpus_missing_on_a_member() -> None:
    assert any("groups.a: 'a' is also a host name" in e for e in errors_of(group(PAIR.replace("pair:", "a:"))))
    text = group(PAIR).replace("    gpus: [0, 1, 2, 3]\n  b:", "  b:")
    assert any("set nproc_per_node (processes per node), or list `gpus:` on every member (missing on a)" in e
               for e in errors_of(text))
    ok = parse_inventory(text.replace("workdir: /srv/w", "workdir: /srv/w\n        nproc_per_node: 2"),
                         file="hosts.yaml", base_dir="/srv/x")
    assert ok.groups["pair"].runs["big"].world_size == 4


def test_a_group_restart_policy_belongs_to_the_group_not_to_its_nodes() -> None:
    text = group(PAIR.replace("workdir: /srv/w", "workdir: /srv/w\n          restart: {when: on-failure, max: 2, "
                                                 "backoff_s: 7, resume_args: [--resume, auto]}"))
    run = parse_inventory(text, file="hosts.yaml", base_dir="/srv/x").groups["pair"].runs["big"]
    assert (run.restart.when, run.restart.max, run.restart.backoff_s, run.restart.resume_args) == (
        "on-failure", 2, 7.0, ["--resume", "auto"])
    # a node's wrapper would restart its node alone: the nodes' own runs never restart
    assert [n.run.restart.when for n in run.nodes] == ["never", "never"]
    plain = parse_inventory(group(PAIR), file="hosts.yaml", base_dir="/srv/x").groups["pair"].runs["big"]
    assert plain.restart is None
