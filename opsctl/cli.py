"""Command line of opsctl: argument parsing, help with examples and exit codes, dispatch to opsctl.commands.

`opsctl --help` (and `opsctl VERB --help`) is meant to teach the tool; keep examples in step with the verbs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from importlib import metadata
from typing import Any, NoReturn

from rich.text import Text

from opsctl import commands
from opsctl.transport import TransportError

# What each exit code means, per verb, for exactly the codes that verb can return: `opsctl VERB --help` prints its
# entry and nothing else, so a code that cannot happen is never listed (tests/test_opsctl_cli.py holds each verb's
# possible codes, read from its code paths, and checks every --help against them). Keys: commands.EXIT_CODES.
_USAGE = "bad command line or hosts.yaml (the message names file, line and field)"
_UNREACHABLE = "host unreachable, host key unknown or changed, authentication refused, unknown host"
_STOPPED = "the host's Proxmox container is stopped (nothing was touched)"
VERB_EXIT_CODES: dict[str, dict[str, str]] = {
    "launch": {
        "ok": "the run is ready (first `step` event or ready_pattern); with --follow: it finished with status 0",
        "failed": "the run crashed or failed before it was ready; with --follow: it exited non-zero or was killed",
        "usage": _USAGE,
        "transport": _UNREACHABLE + " (at once), or with --follow the link lost for longer than the host's "
                     "reconnect_timeout",
        "timeout": "not ready within ready_timeout; the message names the phase it is stuck in (the run is left "
                   "running: inspect with `opsctl logs`, stop with `opsctl kill`)",
        "refused": "preflight refused, nothing started: container stopped, GPUs busy, model dir != manifest, the "
                   "run's preflight command failed, run already running or finished, a cache dir that fails "
                   "validation or that another live run uses (named with its pid); a group run that another opsctl "
                   "supervises (named with its host and pid; --take-over replaces it)",
        "taken_over": "launch GROUP RUN --follow: another opsctl took over the group's supervision (launch "
                      "--take-over); this one stopped supervising, the group goes on under the other one",
    },
    "history": {"ok": "the attempts were printed (none yet is not an error)",
                "failed": "the host's agent sent no history (its error is printed)", "usage": _USAGE,
                "transport": _UNREACHABLE, "refused": _STOPPED},
    "status": {"ok": "every host answered (whatever state its runs are in)", "usage": _USAGE,
               "transport": "a host could not be reached (it is shown as unreachable; the others still answer)",
               "refused": _STOPPED},
    "logs": {"ok": "the lines were printed, or the run was never launched (said on stderr); -f: the run finished "
                   "with status 0",
             "failed": "-f: the run exited non-zero, crashed or was killed", "usage": _USAGE,
             "transport": _UNREACHABLE + " (at once), or -f: the link lost for longer than reconnect_timeout",
             "refused": _STOPPED},
    "kill": {"ok": "the run is stopped (or was not running) and NVML shows none of its processes on a GPU",
             "failed": "processes of the run survived SIGKILL or still hold GPU memory (named with their pids)",
             "usage": _USAGE, "transport": _UNREACHABLE, "refused": _STOPPED},
    "clean": {"ok": "cleaned (or, --dry-run, listed what a clean would remove; a run that is alive now is a "
                    "warning there)",
              "usage": _USAGE, "transport": _UNREACHABLE,
              "refused": "the run is alive, or a directory failed validation (nothing deleted); --dry-run: the "
                         "directory fails validation, as the real clean would; " + _STOPPED},
    "watch": {"ok": "the dashboard was closed; --once: every host answered", "usage": _USAGE,
              "transport": "--once: a host could not be reached (its run is in the snapshot as unreachable)"},
    "export": {"ok": "the events so far are written (or there was nothing new: no event file written); --follow: "
                     "the run ended", "usage": _USAGE + "; DIR holds another run's export or cannot be created",
               "transport": _UNREACHABLE + ", or --follow: the link lost for longer than reconnect_timeout",
               "refused": _STOPPED},
    "hosts": {"ok": "the inventory is valid", "usage": "hosts.yaml is invalid (each problem names file, line and "
              "field)"},
    "init": {"ok": "the file was written", "usage": "the file exists (use --force) or cannot be written"},
    "completion": {"ok": "the script was printed", "usage": "an unknown shell"},
}


def exit_codes_help(verb: str) -> str:
    """The `exit codes:` section of `opsctl VERB --help`: only the codes VERB can return (VERB_EXIT_CODES)."""
    import textwrap

    lines = ["exit codes:"]
    for name, text in VERB_EXIT_CODES[verb].items():
        lines += textwrap.wrap(text, 110, initial_indent=f"  {commands.EXIT_CODES[name]}  ",
                               subsequent_indent="     ", break_on_hyphens=False)
    return "\n".join(lines) + "\n"


EXIT_CODES_HELP = """\
exit codes (`opsctl VERB --help` says which of them each verb returns, and what each means for it):
  0 ok   1 the run failed / kill left survivors   2 bad command line or hosts.yaml   3 host unreachable or link lost
  4 launch: not ready within ready_timeout   5 refused (nothing touched)   6 launch GROUP RUN --follow: taken over
"""

EXAMPLES = """\
examples:
  opsctl hosts check                         validate hosts.yaml without connecting anywhere
  opsctl launch local tiny --follow          preflight, clean the inductor cache, start in tmux, stream
                                             the log until ready, then keep following until the run ends
  opsctl launch pve-box qwen27b              same through SSH + `pct exec 200`; exits 0 as soon as the
                                             first training step is reported, non-zero within 1 s of a crash
  opsctl status pve-box                      state, phase, step, loss, tokens/s, heartbeat age, GPUs
  opsctl status pve-box qwen27b --json       the same as JSON (for scripts)
  opsctl logs pve-box qwen27b -f             follow the log; survives SSH drops without losing a line
  opsctl kill pve-box qwen27b                SIGINT, SIGTERM, SIGKILL to the run's process tree; waits for
                                             run_end and checks through NVML that the GPUs were released
  opsctl history pve-box qwen27b             every attempt: start, duration, how it ended, its checkpoint
  opsctl clean pve-box --dry-run             what clean would delete (inductor cache, dead tmux sessions,
                                             stale pid files) - it only ever deletes inside validated dirs
  opsctl watch                               live dashboard of every run in hosts.yaml
  opsctl status                              every host and run in the inventory, one table
  opsctl export pve-box qwen27b --tensorboard tb/qwen27b
                                             events.jsonl as TensorBoard scalars (tensorboard --logdir tb)
  opsctl hosts                               the hosts, groups and runs of the inventory, and its file
  opsctl launch pair qwen27b                 a hosts.yaml group in place of HOST: one torchrun per member
                                             (node rank, head and port filled), READY when every node stepped;
                                             status, logs [--node I], history, kill, clean, export and watch
                                             take it too; with `restart:` only `launch --follow` restarts it
  opsctl init                                write a commented ./hosts.yaml (local host + SSH/pct/group examples)

inventory: --hosts FILE, else $OPSCTL_HOSTS, else ./hosts.yaml, else ~/.config/opsctl/hosts.yaml, else the
built-in host `local` (said on stderr). Options such as --hosts and --accept-new-host-key go before or after
the verb. Shell completion: eval "$(opsctl completion bash)" (or zsh) in your shell's rc file.
"""


class Parser(argparse.ArgumentParser):
    """argparse with a suggestion for a mistyped verb (`staus` -> `status`), as git and kubectl do."""

    def error(self, message: str) -> NoReturn:
        if self.prog.endswith(" launch") and message.startswith("the following arguments are required"):
            message = ("launch needs HOST and RUN: a run defined under HOST's `runs:` in hosts.yaml, e.g. `opsctl "
                       "launch local tiny` (`opsctl hosts` lists them; `opsctl init` writes a hosts.yaml to start "
                       "from); arguments after -- are added to that run's command for one attempt")
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            message = f"unknown {self._what()} '{m.group(1)}'{hint} (one of: {', '.join(choices)})"
        super().error(message)

    def format_help(self) -> str:
        """A parser may compute its epilog only when its help is asked for (watch: its keys, read from the
        dashboard, which `opsctl --help` need not import)."""
        fn = getattr(self, "epilog_fn", None)
        if fn is not None:
            self.epilog = fn()
        return super().format_help()

    def _what(self) -> str:
        return "verb" if self.prog == "opsctl" else "subcommand"


def _version() -> str:
    try:
        return metadata.version("dflash-ops")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _host_names(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """Shell completion of HOST from the inventory opsctl would use (errors complete nothing)."""
    try:
        return [h for h in commands.Ctx(hosts_file=getattr(parsed_args, "hosts", None)).quiet_inventory().hosts
                if h.startswith(prefix)]
    except Exception:  # noqa: BLE001 - a broken hosts.yaml must not print a traceback into the shell
        return []


def _run_names(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    try:
        inv = commands.Ctx(hosts_file=getattr(parsed_args, "hosts", None)).quiet_inventory()
        return [r for r in inv.runs.get(getattr(parsed_args, "host", None) or "", {}) if r.startswith(prefix)]
    except Exception:  # noqa: BLE001
        return []


def _targets(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    try:
        inv = commands.Ctx(hosts_file=getattr(parsed_args, "hosts", None)).quiet_inventory()
        names = list(inv.hosts) + [f"{h}:{r}" for h, runs in inv.runs.items() for r in runs]
        return [n for n in names if n.startswith(prefix)]
    except Exception:  # noqa: BLE001
        return []


def _host_run(s: argparse.ArgumentParser, run: str = "required") -> None:
    """HOST and RUN positionals, completed from the inventory."""
    h = s.add_argument("host", metavar="HOST", help=_HOST_HELP + (" (default: every host)" if run == "none" else ""),
                       **({"nargs": "?"} if run == "none" else {}))
    h.completer = _host_names  # type: ignore[attr-defined]
    r = s.add_argument("run", metavar="RUN", help=_RUN_HELP + (" (default: every run of HOST)" if run != "required" else ""),
                       **({"nargs": "?"} if run in ("optional", "none") else {}))
    r.completer = _run_names  # type: ignore[attr-defined]


# `opsctl watch --help`: what each key does, by the action it is bound to (the keys themselves are read from the
# dashboard's BINDINGS, so a key added there shows up in --help with at least its footer label).
WATCH_KEY_HELP = {
    "kill": "kill the selected run (asks first)", "clean": "clean the selected run (asks first)",
    "reconnect": "reconnect its link now", "next_run": "next run", "search": "search the log (enter: next match)",
    "charts": "show / hide the charts", "metric": "next metric in the right chart",
    "smoothing": "smoothing of the charts on / off", "gpu_history": "GPU columns: now (bars) / history (sparklines)",
    "screenshot": "SVG screenshot (the notification says where)", "quit": "quit (the runs go on)",
    "severity": "log: show only warnings / errors and up", "next_match": "log: older search match",
    "prev_match": "log: newer search match", "follow": "log: follow its end again",
}
_KEY_NAMES = {"slash": "/", "escape": "esc"}


def watch_keys_help() -> str:
    """Every key of the dashboard (WatchApp and its log pane), from their BINDINGS, one per line."""
    from opsctl.tui import WatchApp
    from opsctl.widgets import LogPane

    seen: dict[str, list[str]] = {}
    for binding in [*WatchApp.BINDINGS, *LogPane.BINDINGS]:
        keys = [_KEY_NAMES.get(k.strip(), k.strip()) for k in binding.key.split(",")]  # type: ignore[union-attr]
        what = WATCH_KEY_HELP.get(binding.action, binding.description)  # type: ignore[union-attr]
        seen.setdefault(what, [])
        seen[what] += [k for k in keys if k not in seen[what]]
    width = max(len(" ".join(k)) for k in seen.values())
    return "keys:\n" + "".join(f"  {' '.join(k):<{width}}  {what}\n" for what, k in seen.items())


_RUN_HELP = "a run of HOST's `runs:` in hosts.yaml (`opsctl hosts` lists them)"
_HOST_HELP = "a host of hosts.yaml, or a group (`groups:`) to act on every node of a group run"


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = Parser(
        prog="opsctl", formatter_class=fmt,
        description="Launch, follow, inspect, kill and clean training runs on local hosts, SSH hosts and "
                    "Proxmox containers, without sleep-and-poll: every verb reads a live stream from a small "
                    "agent that opsctl sends over the channel (nothing to install remotely but python3 + tmux).",
        epilog=EXAMPLES + "\n" + EXIT_CODES_HELP)
    p.add_argument("--hosts", metavar="FILE", default=None,
                   help="inventory file (default: $OPSCTL_HOSTS, ./hosts.yaml, ~/.config/opsctl/hosts.yaml, "
                        "else the built-in host `local`)")
    p.add_argument("--accept-new-host-key", action="store_true", default=False,
                   help="trust an SSH host key that is not in known_hosts yet (and record it)")
    p.add_argument("--version", action="version", version=f"opsctl (dflash-ops) {_version()}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True, parser_class=Parser)

    s = sub.add_parser("launch", formatter_class=fmt, help="preflight, start in tmux, stream until ready",
                       description="Preflight (container running, GPUs free, model dir vs manifest, the run's "
                       "preflight command), clear or keep the run's own inductor cache (inductor_cache_policy "
                       "clear | keyed, --fresh-cache; it says what it did and why), keep the previous attempt's "
                       "log as LOG.1, start the run in tmux (exit status "
                       "captured, log teed, pid and process group recorded), then stream its log until it "
                       "reports ready (first `step` event or ready_pattern). Exits non-zero within 1 s if it "
                       "dies first, printing the traceback; after ready_timeout it names the phase it is stuck "
                       "in and leaves it running.", epilog="""examples:
  opsctl launch local tiny --follow          start, stream until ready, keep following until it ends
  opsctl launch box r -- --max-steps 200     one attempt with extra arguments for the run's command
  opsctl launch box r --follow --progress    follow as one progress bar (step, loss, tau, tokens/s)
""" + "\n" + exit_codes_help("launch"))
    _host_run(s)
    s.add_argument("--force", action="store_true", help="start even if other processes hold the GPUs")
    s.add_argument("--follow", action="store_true",
                   help="after ready, keep streaming the log until the run ends; exit with its status. For a "
                        "group run with a restart policy this opsctl is what restarts the group (every node "
                        "stopped, then started again): nothing on the hosts does; keep it running. On a group "
                        "that already runs on every node it starts nothing and takes over following it. One "
                        "opsctl supervises a group at a time: while another one does (its lease on the head node "
                        "is live) this launch is refused, naming it")
    s.add_argument("--take-over", action="store_true",
                   help="with --follow on a group run: supervise it even though another opsctl does (that one "
                        "is gone, or supervision moves here); the other one stops supervising at its next heartbeat and "
                        f"exits with {commands.EXIT_TAKEN_OVER}. A supervisor that died without releasing is "
                        "replaced without it, once its heartbeat is stale")
    s.add_argument("--fresh-cache", action="store_true",
                   help="empty the run's inductor cache first, whatever inductor_cache_policy says")
    s.add_argument("--progress", action="store_true",
                   help="with --follow on a terminal: after the first step, one progress bar (step/total, loss, tau of the last "
                        "in-training eval, tokens/s, ETA) instead of every log line; warnings, errors, evaluations "
                        "and checkpoints still print, and the log keeps every line. Into a pipe: one line per 1/20 "
                        "of the run")
    s.add_argument("extra_args", nargs="*", default=[], metavar="-- ARGS",
                   help="after --: arguments appended to the run's command for this attempt only (e.g. "
                        "`opsctl launch box r -- --max-steps 200`); recorded in `opsctl history`")

    s = sub.add_parser("history", formatter_class=fmt, help="every attempt of a run: start, duration, how it ended",
                       description="Every launch of the run is an attempt, and so is every restart the run's "
                       "restart policy made: its id, start time, duration, how it ended (finished, crashed with "
                       "its exception line, killed, refused with the reason, running, restarting, lost), exit "
                       "code, first and last step, the log file that holds it now (LOG, LOG.1, ...), its last "
                       "checkpoint and the extra arguments it was given. Newest last. Read from the run's state "
                       "dir on the host, so every client sees the same history. For a group run (HOST names a group): one row per "
                       "attempt of the group, with how each node's own attempt ended and which node failed first.",
                       epilog="""examples:
  opsctl history pve-box qwen27b          one row per attempt
  opsctl history pve-box qwen27b --json   the same as a JSON list (one object per attempt)
  opsctl history pair qwen27b             a group run: one row per attempt of the group, a line per node

""" + exit_codes_help("history"))
    _host_run(s)
    s.add_argument("--json", action="store_true", help="print a JSON list instead of a table")

    s = sub.add_parser("status", formatter_class=fmt, help="state, phase, step, loss, tokens/s, GPUs",
                       description="One snapshot per run: state (starting, loading, compiling, training, "
                       "stalled, finished, crashed, killed), phase, step, last loss, tokens/s, heartbeat age, "
                       "GPUs, alerts. Without RUN: every run of HOST; without HOST: every host and run of the "
                       "inventory (an unreachable host is shown as such, the others still answer). --json prints a "
                       "list with one object per run, whatever the arguments: the schema `watch --once --json` "
                       "prints too (docs/cli-json.md). Exit 3 when a host could not be reached.",
                       epilog=exit_codes_help("status"))
    _host_run(s, run="none")
    s.add_argument("--json", action="store_true", help="print JSON (a list of runs) instead of a table")

    s = sub.add_parser("logs", formatter_class=fmt, help="print or follow a run's log",
                       description="Print the last N lines, or follow (-f) with reconnect: after an SSH drop "
                       "it reconnects with back-off and jitter, each retry said on stderr, for up to the host's "
                       "reconnect_timeout (default 300 s, 0 = forever), and resumes at the last byte offset, so "
                       "no line is lost or repeated; a host key, authentication or unknown-host error exits 3 at "
                       "once. -f ends when the run ends, with exit 0 if its status was 0. Shows the current "
                       "attempt; --all every kept attempt.", epilog="""examples:
  opsctl logs box r -n 100                   the last 100 lines
  opsctl logs box r -f                       follow until the run ends; exit with its status
  opsctl logs box r -f --progress            follow as one progress bar (the log keeps every line)
""" + "\n" + exit_codes_help("logs"))
    _host_run(s)
    s.add_argument("-f", "--follow", action="store_true",
                   help="keep printing new lines until the run ends (reconnecting after a drop); exit 0 if it "
                        "finished with status 0, else 1")
    s.add_argument("-n", "--lines", type=int, default=None, metavar="N",
                   help="lines of history (default 50; with --all: the last N of each attempt, default all; with --progress 0: "
                        "the bar sums up what came before)")
    s.add_argument("--progress", action="store_true", help="with -f on a terminal: after the first step, one progress bar (step/total, loss, tau of the last "
                        "in-training eval, tokens/s, ETA) instead of every log line; warnings, errors, evaluations "
                        "and checkpoints still print, and the log keeps every line. Into a pipe: one line per 1/20 "
                        "of the run")
    s.add_argument("--all", action="store_true",
                   help="every kept attempt's log (LOG.N ... LOG.1, then the current LOG), each under a header")
    s.add_argument("--node", type=int, metavar="I", default=None,
                   help="a group run (HOST names a group): only node I's log, without the [nodeI host] prefix")

    s = sub.add_parser("kill", formatter_class=fmt, help="stop a run: SIGINT, SIGTERM, SIGKILL",
                       description="Signal the recorded process group and every descendant (also those that "
                       "left the group): SIGINT, wait kill_grace[0]; SIGTERM, wait kill_grace[1]; SIGKILL. "
                       "Reports the training core's run_end and checkpoint, and whether NVML still shows a "
                       "process of the run holding GPU memory. Processes are never matched by name.",
                       epilog=exit_codes_help("kill"))
    _host_run(s)

    s = sub.add_parser("clean", formatter_class=fmt, help="inductor cache, dead tmux sessions, stale pid files",
                       description="Empty the run's inductor cache dir (only after validation: absolute, not "
                       "/, ~ or a system dir, inside clean_roots, symlinks resolved), remove dead tmux sessions "
                       "of our runs and stale pid files. Refuses while the run is alive. Without RUN: every "
                       "run of HOST.", epilog=exit_codes_help("clean"))
    _host_run(s, run="optional")
    s.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    s.add_argument("--logs", action="store_true",
                   help="also remove earlier attempts' logs (LOG.1 ... LOG.N); the current log always stays")

    watch_examples = """examples:
  opsctl watch                         every run in hosts.yaml
  opsctl watch pve-box:qwen27b local   one run of pve-box and every run of local
  opsctl watch --plain                 the same numbers as a scrolling rich view (no full-screen terminal)
  opsctl watch --once                  one JSON snapshot of every run (state, step, loss, GPUs, alerts):
                                       the schema of `status --json` (docs/cli-json.md); exit 0 when every
                                       host answered, 3 when one could not be reached
"""
    s = sub.add_parser("watch", formatter_class=fmt, help="live dashboard (Textual) of one or many runs",
                       description="A full-screen dashboard of every run you name (default: every run in "
                       "hosts.yaml): state, step, loss, tokens/s, ETA, tau, GPUs, alerts, charts and the log, "
                       "one worker per run, so a dead host never freezes the others. Kill, clean and reconnect "
                       "from the keyboard. --plain for terminals without full-screen support, --once for scripts.",
                       epilog=watch_examples)
    s.epilog_fn = lambda: (watch_examples + "\n" + watch_keys_help()  # type: ignore[attr-defined]
                           + "\n" + exit_codes_help("watch"))
    t = s.add_argument("targets", nargs="*", metavar="HOST[:RUN]", help="runs to watch (default: all in hosts.yaml)")
    t.completer = _targets  # type: ignore[attr-defined]
    s.add_argument("--plain", action="store_true", help="rich Live output instead of the full-screen app")
    s.add_argument("--once", action="store_true",
                   help="print one JSON snapshot (a list, one object per run) and exit: 0 every host answered, "
                        "3 one could not be reached")
    s.add_argument("--json", action="store_true", help="same as --once (the snapshot is JSON)")
    s.add_argument("--bell", action="store_true", help="ring the terminal bell on new alerts")

    s = sub.add_parser("export", formatter_class=fmt, help="a run's events.jsonl as TensorBoard scalars",
                       description="Read the run's whole events.jsonl through the agent and write TensorBoard event "
                       "files into DIR (with tensorboard's own writer): loss, per-position accuracy, lr, grad norm, "
                       "tokens/s, step time, queue depth and wait, recompiles, and per rank the heartbeat's memory. "
                       "A resumed attempt starts a new TensorBoard session at its step, so TensorBoard drops the "
                       "steps the crash lost. Export again into the same DIR and only new events are added (none new: no event file, said in one line). "
                       "--follow keeps adding steps and NVML samples (GPU util, memory, power, temperature) "
                       "until the run ends. W&B reads DIR with `wandb sync --sync-tensorboard DIR`. Tags: train/*, "
                       "acc/*, perf/*, queue/*, compile/*, checkpoint/*, rank{R}/rss_mb, gpu_mem_mb, gpu_reserved_mb and "
                       "gpu_alloc_retries, "
                       "gpu{I}/util_pct, mem_used_mb, power_w, temp_c, sm_clock_mhz. For a group run (HOST names a "
                       "group): the training scalars from node 0 (it holds global rank 0), and every node's ranks "
                       "and GPUs under node{N}/ (node{N}/rank{R}/..., R the global rank; node{N}/gpu{I}/..., I the "
                       "node's own GPU index); --follow follows every node until the group run ends.",
                       epilog="""examples:
  opsctl export pve-box qwen27b --tensorboard tb/qwen27b     then: tensorboard --logdir tb
  opsctl export local tiny --tensorboard tb/tiny --follow   keep adding steps and GPU samples
  opsctl export pair qwen27b --tensorboard tb/pair-qwen27b  a group run: node 0's steps, node{N}/ per node
""" + "\n" + exit_codes_help("export"))
    _host_run(s)
    s.add_argument("--tensorboard", metavar="DIR", required=True, help="directory for the TensorBoard event files")
    s.add_argument("--follow", "-f", action="store_true",
                   help="keep exporting new events and GPU samples until the run ends (reconnects like logs -f)")

    s = sub.add_parser("hosts", formatter_class=fmt, help="list the inventory's hosts, groups and runs; `hosts check`",
                       description="Without a subcommand: every host of the inventory (how it is reached, its "
                       "GPUs and runs), every group (its members in node order, the head first, the rendezvous "
                       "and each run's nodes x ranks) and which file it came from. `hosts check` validates the file without "
                       "connecting anywhere.", epilog=exit_codes_help("hosts"))
    hs = s.add_subparsers(dest="hosts_verb", metavar="check", parser_class=Parser)
    hs.add_parser("check", help="validate hosts.yaml without connecting")

    s = sub.add_parser("init", formatter_class=fmt, help="write a commented hosts.yaml to start from",
                       description="Write a commented inventory: the local host with the tiny run, and an SSH and a "
                       "Proxmox (pct) example to uncomment. An existing file is never overwritten without --force.",
                       epilog=exit_codes_help("init"))
    s.add_argument("path", nargs="?", default="hosts.yaml", help="where to write it (default ./hosts.yaml)")
    s.add_argument("--force", action="store_true", help="replace an existing file")

    s = sub.add_parser("completion", formatter_class=fmt, help="shell completion script (bash, zsh)",
                       description="Print the completion script for your shell (verbs, options, and the hosts and "
                       "runs of your inventory). Load it from your shell's rc file.",
                       epilog="""examples:
  echo 'eval "$(opsctl completion bash)"' >> ~/.bashrc
  echo 'eval "$(opsctl completion zsh)"' >> ~/.zshrc

""" + exit_codes_help("completion"))
    s.add_argument("shell", choices=["bash", "zsh"])
    for verb_parser in _subparsers(p):
        _add_global_options(verb_parser)
    return p


def _subparsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every verb's parser (and theirs, e.g. `hosts check`), however many verbs are added above."""
    found: list[argparse.ArgumentParser] = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *_subparsers(child)]
    return found


def _add_global_options(verb_parser: argparse.ArgumentParser) -> None:
    """The global options, accepted after the verb too (`opsctl status newbox --accept-new-host-key`, as the
    error message suggests). SUPPRESS: a verb's parser leaves what was given before the verb as it was."""
    verb_parser.add_argument("--hosts", metavar="FILE", default=argparse.SUPPRESS,
                             help="inventory file (same as before the verb)")
    verb_parser.add_argument("--accept-new-host-key", action="store_true", default=argparse.SUPPRESS,
                             help="trust an SSH host key not in known_hosts yet (same as before the verb)")


def _verb_of(argv: list[str]) -> str | None:
    """The verb of a command line: its first word that is neither an option nor the value of --hosts."""
    value = False
    for a in argv:
        if value:
            value = False
        elif a == "--hosts":
            value = True
        elif not a.startswith("-"):
            return a
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if os.environ.get("_ARGCOMPLETE"):  # the shell asks for completions (opsctl completion bash|zsh)
        import argcomplete

        argcomplete.autocomplete(parser)
    # `launch HOST RUN [options] -- ARGS`: what follows `--` is the run's, whatever it looks like (argparse alone
    # cannot take it once an option came between RUN and `--`).
    given = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] | None = None
    if "--" in given and _verb_of(given[:given.index("--")]) == "launch":
        given, extra = given[:given.index("--")], given[given.index("--") + 1:]
    args = parser.parse_args(given)
    if args.verb == "logs" and args.lines is None and args.progress:  # the bar sums up the backlog: no lines first
        args.lines = 0
    ctx = commands.Ctx(hosts_file=args.hosts, accept_new_host_key=args.accept_new_host_key)
    try:
        from opsctl.group_verbs import dispatch  # HOST may name a group of hosts (hosts.yaml `groups:`)

        if (group_rc := dispatch(ctx, args, extra)) is not None:
            return group_rc
        if args.verb == "launch":
            if args.extra_args:
                raise commands.OpsError(f"unexpected arguments {' '.join(args.extra_args)!r}: arguments for the "
                                        "run's command go after --, e.g. opsctl launch HOST RUN -- --max-steps 200",
                                        commands.EXIT_USAGE)
            if args.take_over:
                raise commands.OpsError("--take-over is for group runs (a HOST that names a group in hosts.yaml)",
                                        commands.EXIT_USAGE)
            if args.progress and not args.follow:
                raise commands.OpsError("--progress draws the run's training while following it: add --follow",
                                        commands.EXIT_USAGE)
            return commands.cmd_launch(ctx, args.host, args.run, force=args.force, follow=args.follow,
                                       fresh_cache=args.fresh_cache, extra_args=extra, progress=args.progress)
        if args.verb == "history":
            from opsctl.history import cmd_history

            return cmd_history(ctx, args.host, args.run, as_json=args.json)
        if args.verb == "status":
            return commands.cmd_status(ctx, args.host, args.run, as_json=args.json)
        if args.verb == "logs":
            if args.lines is not None and args.lines < 0:
                raise commands.OpsError("-n must be >= 0", commands.EXIT_USAGE)
            if args.progress and not args.follow:
                raise commands.OpsError("--progress draws the run's training while following it: add -f",
                                        commands.EXIT_USAGE)
            return commands.cmd_logs(ctx, args.host, args.run, follow=args.follow, lines=args.lines, all_attempts=args.all,
                                     progress=args.progress)
        if args.verb == "kill":
            return commands.cmd_kill(ctx, args.host, args.run)
        if args.verb == "clean":
            return commands.cmd_clean(ctx, args.host, args.run, dry_run=args.dry_run, logs=args.logs)
        if args.verb == "watch":
            from opsctl.tui import watch_main

            return watch_main(commands.watch_sources(ctx, args.targets), plain=args.plain,  # type: ignore[arg-type]
                              once_json=args.once or args.json, bell=args.bell)
        if args.verb == "export":
            from opsctl.export import cmd_export

            return cmd_export(ctx, args.host, args.run, args.tensorboard, follow=args.follow)
        if args.verb == "hosts":
            if args.hosts_verb == "check":
                return commands.cmd_hosts_check(ctx)
            return commands.cmd_hosts_list(ctx)
        if args.verb == "init":
            return commands.cmd_init(ctx, args.path, force=args.force)
        if args.verb == "completion":
            import argcomplete

            ctx.raw.write(argcomplete.shellcode(["opsctl"], shell=args.shell))
            ctx.raw.flush()
            return commands.EXIT_OK
    except commands.OpsError as exc:
        ctx.err.print(Text.assemble(("opsctl: ", "bold red"), str(exc)), soft_wrap=True)
        return exc.code
    except TransportError as exc:
        ctx.err.print(Text.assemble(("opsctl: ", "bold red"), str(exc)), soft_wrap=True)
        return commands.EXIT_TRANSPORT
    except KeyboardInterrupt:
        ctx.err.print("[yellow]interrupted (the run itself keeps going; stop it with `opsctl kill`)[/]")
        return 130
    return commands.EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
