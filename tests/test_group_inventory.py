"""Groups in the inventory's own views: `opsctl hosts` lists them with their members, `opsctl hosts check` counts
them, and `opsctl init` writes a commented group example that loads once uncommented.

Through the real CLI (`python -m opsctl`); nothing connects anywhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from opsctl.config import load_inventory

REPO = Path(__file__).resolve().parent.parent


def cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb",
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "opsctl", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def uncommented(text: str) -> str:
    """The init template with its examples uncommented: the hosts' entries (indented under `hosts:`) and the
    `groups:` block at the end, never the prose above them."""
    host_line = re.compile(r"^  # (\s{2,}\S|\s*[\w.-]+:)")
    head, _, groups = text.partition("\n# groups:\n")
    lines = [ln.replace("  # ", "  ", 1) if host_line.match(ln) else ln for ln in head.splitlines()]
    lines.append("groups:")
    lines += [ln[2:] if ln.startswith("#   ") else ln for ln in groups.splitlines()]
    return "\n".join(lines) + "\n"


def test_init_has_a_commented_group_example_that_loads(tmp_path: Path) -> None:
    assert cli("init", cwd=tmp_path).returncode == 0
    text = (tmp_path / "hosts.yaml").read_text()
    assert "\n# groups:\n#   pair:\n#     members: [gpu1, pve-box]" in text
    assert list(load_inventory(tmp_path / "hosts.yaml").groups) == []  # commented out: no group until edited
    full = tmp_path / "full.yaml"
    full.write_text(uncommented(text))
    inv = load_inventory(full)
    run = inv.groups["pair"].runs["qwen27b"]
    assert [n.host.name for n in run.nodes] == ["gpu1", "pve-box"] and run.world_size == 16
    assert run.restart is not None and (run.restart.max, run.restart.backoff_s) == (3, 120.0)
    argv = run.nodes[1].run.argv
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[argv.index("--rdzv-endpoint") + 1] == (
        "gpu1.example.org:29400")
    r = cli("hosts", "check", "--hosts", str(full), cwd=tmp_path)
    assert r.returncode == 0 and "ok group pair (gpu1, pve-box): qwen27b" in r.stdout, r.stdout + r.stderr
    assert "1 group(s)" in r.stderr


def test_hosts_lists_groups_with_their_members_in_node_order(tmp_path: Path) -> None:
    inv = tmp_path / "hosts.yaml"
    inv.write_text("""\
hosts:
  a: {ssh: {host: 10.0.0.1}, gpus: [0, 1]}
  b: {ssh: {host: 10.0.0.2}, gpus: [0, 1]}
  c: {ssh: {host: 10.0.0.3}, pct: 200, gpus: [0, 1]}
groups:
  trio:
    members: [a, b, c]
    head: b
    port: 29501
    runs:
      big:
        workdir: /srv/w
        command: [-m, dflash, train]
        log: train.log
        restart: {when: on-failure, max: 2}
      small: {nproc_per_node: 1, workdir: /srv/w, command: [-m, dflash, train], log: small.log}
  empty: {members: [a]}
""")
    r = cli("hosts", "--hosts", str(inv), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "groups: one run across several hosts" in out
    trio = [ln for ln in out.splitlines() if "trio" in ln][0]
    # the head is node 0: listed first, marked; then the other members in their order
    assert "b (head), a, c" in trio and "10.0.0.2:29501" in trio, out
    assert "big: 3 x 2 = world 6, restart on-failure max 2 (by launch --follow)" in trio, out
    assert "small: 3 x 1 = world 3" in out and "(no runs)" in [ln for ln in out.splitlines() if "empty" in ln][0]
    # the hosts' own table is still there, before the groups
    assert out.index("ssh 10.0.0.3:22 -> pct 200") < out.index("trio")
    plain = tmp_path / "plain.yaml"
    plain.write_text("hosts:\n  a: {local: true}\n")
    r = cli("hosts", "--hosts", str(plain), cwd=tmp_path)
    assert r.returncode == 0 and "one run across several hosts" not in r.stdout  # no groups: no empty table
