"""Where opsctl finds its hosts.yaml (--hosts, $OPSCTL_HOSTS, ./hosts.yaml, ~/.config/opsctl/hosts.yaml, built-in),
and `opsctl init`, which writes a commented one. Validation stays in opsctl/config.py; this only picks the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from opsctl.config import DEFAULT_HOSTS_FILE, ENV_HOSTS_FILE, builtin_tiny_config

BUILTIN = "<built-in inventory: host `local`, run `tiny`>"
SEARCH_ORDER = f"--hosts, ${ENV_HOSTS_FILE}, ./{DEFAULT_HOSTS_FILE}, ~/.config/opsctl/{DEFAULT_HOSTS_FILE}"


def user_config_path() -> Path:
    """The per-user inventory: $XDG_CONFIG_HOME/opsctl/hosts.yaml (default ~/.config/opsctl/hosts.yaml)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "opsctl" / DEFAULT_HOSTS_FILE


@dataclass(frozen=True)
class Found:
    """The inventory file to load (None: the built-in one) and which rule picked it, for the messages."""

    path: Path | None
    how: str  # "--hosts", "$OPSCTL_HOSTS", "./hosts.yaml", "~/.config/opsctl/hosts.yaml" or "built-in"

    def describe(self) -> str:
        return BUILTIN if self.path is None else f"{self.path} (from {self.how})"


def discover(explicit: str | None) -> Found:
    """The first of --hosts, $OPSCTL_HOSTS, ./hosts.yaml, ~/.config/opsctl/hosts.yaml; else the built-in inventory.

    An explicit --hosts or $OPSCTL_HOSTS is returned even when missing, so the loader says `file not found` about
    the very file the person named; the two implicit places only count when they exist."""
    if explicit:
        return Found(Path(explicit), "--hosts")
    env = os.environ.get(ENV_HOSTS_FILE)
    if env:
        return Found(Path(env), f"${ENV_HOSTS_FILE}")
    here = Path(DEFAULT_HOSTS_FILE)
    if here.is_file():
        return Found(here, f"./{DEFAULT_HOSTS_FILE}")
    user = user_config_path()
    if user.is_file():
        return Found(user, f"~/.config/opsctl/{DEFAULT_HOSTS_FILE}")
    return Found(None, "built-in")


def builtin_notice() -> str:
    """What opsctl says (on stderr) when it falls back to the built-in inventory: never silently."""
    return (f"no hosts.yaml found (looked at {SEARCH_ORDER}): using the built-in host `local` with the run `tiny`; "
            "`opsctl init` writes a hosts.yaml to edit")


INIT_TEMPLATE = """\
# opsctl inventory, written by `opsctl init`: the machines runs happen on, how to reach them, and the runs.
# opsctl looks for it in this order: --hosts FILE, $OPSCTL_HOSTS, ./hosts.yaml, ~/.config/opsctl/hosts.yaml.
# Check it without connecting anywhere: `opsctl hosts check`; list what it defines: `opsctl hosts`.
#
# A host is reached one of three ways:
#   local: true               commands run on this machine (argv, no shell)
#   ssh: {host: ..., ...}     over SSH; unset fields fall back to ~/.ssh/config, host keys to known_hosts
#   pct: VMID (with ssh)      inside Proxmox container VMID, through `pct exec VMID -- ...` on that host
# A run is a command (argv list; "{python}" = the interpreter that runs opsctl on a local host, the host's
# `python:` elsewhere) with its log and events.jsonl. Relative paths resolve against the workdir, and a
# relative workdir against this file's directory (local hosts only).
# Runs that share settings: put them under a top-level `x-` key as a YAML anchor and merge it into each run,
#   x-run: &run {workdir: /srv/dflash-ops, ready_timeout: 900}     then in a run:  <<: *run
# (keys written next to the merge override it; `x-` keys are not validated on their own).

hosts:
  local:
    local: true
    runs:
      tiny:
        # The training core's tiny CPU run; --resume auto continues after `opsctl kill local tiny`. Its config,
        # tiny.yaml, was written beside this file (a copy of configs/tiny.yaml, shipped with dflash).
        workdir: .
        command: ["{python}", -m, dflash, train, --config, tiny.yaml, --out, runs/tiny, --resume, auto]
        log: runs/tiny/train.log
        events: runs/tiny/events.jsonl
        tmux_session: dflash-tiny
        ready_timeout: 600

  # An SSH host (a GPU box you log into directly): uncomment and edit.
  # gpu1:
  #   ssh:
  #     host: gpu1.example.org
  #     user: ml
  #     port: 22
  #     identity_file: ~/.ssh/id_ed25519
  #   gpus: [0, 1, 2, 3, 4, 5, 6, 7]
  #   runs:
  #     drafter:
  #       workdir: /home/ml/dflash-ops
  #       command: [python3, -m, torch.distributed.run, --nproc-per-node, "8", -m, dflash, train,
  #                 --config, configs/qwen3.6-27b.yaml, --out, runs/qwen27b, --resume, auto]
  #       log: runs/qwen27b/train.log
  #       events: runs/qwen27b/events.jsonl

  # A Proxmox container: SSH to the Proxmox host as root, then `pct exec 200 -- ...` inside CT 200.
  # pve-box:
  #   ssh:
  #     host: pve-box.example.org
  #     user: root
  #   pct: 200
  #   gpus: [0, 1, 2, 3, 4, 5, 6, 7]
  #   runs:
  #     qwen27b:
  #       workdir: /workspace/dflash-ops
  #       command: [python3, -m, torch.distributed.run, --nproc-per-node, "8", -m, dflash, train,
  #                 --config, configs/qwen3.6-27b.yaml, --out, /workspace/runs/qwen27b, --resume, auto]
  #       log: /workspace/runs/qwen27b/train.log
  #       events: /workspace/runs/qwen27b/events.jsonl
  #       ready_timeout: 1800              # loading a large target takes a while
  #       kill_grace: [60, 20]             # seconds after SIGINT, then SIGTERM: time to checkpoint

# A group: one run across several hosts above, through torchrun's c10d rendezvous (docs/scaling.md). opsctl starts
# `torchrun --nnodes N --node-rank i --rdzv-endpoint HEAD:PORT ... COMMAND` on every member (node i = members[i],
# node 0 = the head, which hosts the rendezvous; the launcher is `{python} -m dflash.torchrun`, torchrun whose head
# keeps the rendezvous up until every node left); every verb takes the group in place of HOST
# (`opsctl launch pair qwen27b`, status, logs [--node I], history, kill, clean, watch pair:qwen27b).
# groups:
#   pair:
#     members: [gpu1, pve-box]             # hosts above, each with its own ssh / pct settings
#     port: 29400                          # the rendezvous port on the head: every node must reach it
#     runs:
#       qwen27b:
#         nproc_per_node: 8                # default: the members' `gpus:` count
#         workdir: /workspace/dflash-ops
#         command: [-m, dflash, train, --config, configs/qwen3.6-27b.yaml, --out, /workspace/runs/qwen27b-pair,
#                   --resume, auto]        # what torchrun starts; opsctl fills --nnodes, --node-rank, ...
#         log: /workspace/runs/qwen27b-pair/train.log       # its own files: not pve-box's qwen27b run's
#         events: /workspace/runs/qwen27b-pair/events.jsonl
#         env: {NCCL_SOCKET_IFNAME: eth0}
#         # The group restarted as a whole when a node crashes: only while `opsctl launch pair qwen27b --follow`
#         # runs (no process on one host can restart the others), so keep that in tmux on a machine that stays up.
#         restart: {when: on-failure, max: 3, backoff_s: 120}
"""


# The sample run's config: configs/tiny.yaml as shipped in the dflash package (opsctl.config.builtin_tiny_config),
# copied beside the written hosts.yaml so the sample starts wherever `opsctl init` ran, from a checkout or an
# installed package alike (a relative `configs/tiny.yaml` only resolved inside the repository).
INIT_CONFIG_NAME = "tiny.yaml"


def sample_config_source() -> Path | None:
    """The packaged tiny config to copy (None: an install without dflash's package data)."""
    return builtin_tiny_config()


def write_init_config(hosts_path: Path) -> str:
    """Put the sample run's config beside `hosts_path`; returns what was done, for the message. A file already there
    is kept (it may be the user's edit, and `--force` is about hosts.yaml)."""
    dest = hosts_path.parent / INIT_CONFIG_NAME
    if dest.exists():
        return f"kept the existing {dest.resolve()} (the sample run's config)"
    src = sample_config_source()
    if src is None:
        return (f"no dflash/configs/tiny.yaml in the installed dflash package to copy: put a dflash config at "
                f"{dest.resolve()} "
                "before launching the sample run `tiny`")
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(src.read_bytes())
    tmp.replace(dest)
    return f"wrote {dest.resolve()} (the sample run's config, from {src})"


def write_init(path: Path, force: bool = False) -> Path:
    """Write the commented starter inventory to `path`; an existing file is kept unless `force` (FileExistsError)."""
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; not overwritten (pass --force to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(INIT_TEMPLATE, encoding="utf-8")
    tmp.replace(path)
    return path
