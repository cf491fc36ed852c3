"""opsctl's command-line conventions, run as a user runs them (`python -m opsctl` in a subprocess, real sshd):
options after the verb, --version, did-you-mean, status of everything, `hosts`, one JSON schema, unwrapped pipes,
inventory discovery, `init` and shell completion.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opsctl.config import load_inventory

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import REPO, script_run  # noqa: E402


def cli(*argv: str, cwd: Path = REPO, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m opsctl ARGV` with stdout and stderr piped (so: not a terminal) and no COLUMNS unless given."""
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "OPSCTL_HOSTS", "XDG_CONFIG_HOME")}
    base.update({"NO_COLOR": "1", "TERM": "dumb", "PYTHONPATH": str(REPO)})
    return subprocess.run([sys.executable, "-m", "opsctl", *argv], cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused


def test_version_and_a_mistyped_verb_host_or_run_gets_a_suggestion(tmp_path: Path, sshd) -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("opsctl (dflash-ops) 0."), r
    r = cli("staus")
    assert r.returncode == 2 and "unknown verb 'staus'; did you mean 'status'?" in r.stderr, r.stderr
    r = cli("hosts", "chek")
    assert r.returncode == 2 and "did you mean 'check'?" in r.stderr, r.stderr
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"qwen27b": script_run(tmp_path, "ok_run.py")})
    r = cli("status", "bx", "--hosts", str(hosts))
    assert r.returncode == 2 and "unknown host 'bx' (did you mean 'box'?)" in r.stderr, r.stderr
    r = cli("logs", "box", "qwen72b", "--hosts", str(hosts))
    assert r.returncode == 2 and "unknown run 'qwen72b' (did you mean 'qwen27b'?)" in r.stderr, r.stderr


def test_global_options_work_after_the_verb_as_the_host_key_error_suggests(tmp_path: Path, sshd) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", known_hosts=str(empty),
                                  runs={"a": script_run(tmp_path, "ok_run.py")})
    r = cli("status", "box", "--hosts", str(hosts))
    assert r.returncode == 3 and "--accept-new-host-key" in r.stderr, r.stderr
    r = cli("status", "box", "--hosts", str(hosts), "--accept-new-host-key", "--json")  # what the error suggests
    assert r.returncode == 0, r.stderr
    assert [(row["host"], row["run"], row["state"]) for row in json.loads(r.stdout)] == [("box", "a", "absent")]
    assert empty.read_text().strip(), "the accepted key was recorded"
    r = cli("--hosts", str(hosts), "status", "box")  # before the verb still works, and the key is known now
    assert r.returncode == 0, r.stderr


def test_status_without_host_covers_every_host_and_one_json_schema_with_watch_once(tmp_path: Path, sshd) -> None:
    run = script_run(tmp_path, "ok_run.py", "--steps", "2", "--step-time", "0.05", tmux_session="cli-a")
    hosts = tmp_path / "hosts.yaml"
    entry = sshd.host_entry()
    hosts.write_text(yaml.safe_dump({"hosts": {
        "box": {**entry, "runs": {"a": run}},
        "gone": {**sshd.host_entry(port=_dead_port()), "runs": {"x": script_run(tmp_path, "ok_run.py")}},
    }}, sort_keys=False))
    try:
        r = cli("launch", "box", "a", "--follow", "--hosts", str(hosts))
        assert r.returncode == 0, r.stderr
        r = cli("status", "--json", "--hosts", str(hosts))
        assert r.returncode == 3, r.stderr  # one host unreachable: said by the exit code, the others still shown
        rows = json.loads(r.stdout)
        assert [(row["host"], row["run"], row["state"]) for row in rows] == [("box", "a", "finished"),
                                                                             ("gone", "x", "unreachable")], rows
        assert rows[0]["link"] == "up" and rows[1]["link"] == "unreachable"
        one = json.loads(cli("status", "box", "a", "--json", "--hosts", str(hosts)).stdout)
        assert isinstance(one, list) and len(one) == 1 and one[0]["step"] == 2  # a list whatever the arguments
        w = cli("watch", "--once", "box:a", "gone:x", "--hosts", str(hosts), timeout=180)
        assert w.returncode == 3, w.stderr  # as status: 3 when a host could not be reached
        snaps = json.loads(w.stdout)
        assert [list(s) for s in snaps] == [list(rows[0])] * 2  # the same fields, in the same order
        assert (snaps[0]["host"], snaps[0]["run"], snaps[0]["state"], snaps[0]["step"]) == ("box", "a", "finished", 2)
        assert snaps[1]["state"] == "unreachable"
        table = cli("status", "--hosts", str(hosts))
        lines = table.stdout.splitlines()
        assert any("box" in ln and " a " in ln and "finished" in ln for ln in lines), table.stdout
        assert any("gone" in ln and "unreachable" in ln for ln in lines), table.stdout
    finally:
        cli("clean", "box", "a", "--hosts", str(hosts))


def test_hosts_lists_the_inventory_and_piped_output_does_not_wrap_at_80_columns(tmp_path: Path, sshd) -> None:
    long_name = "a-run-with-a-rather-long-name-" + "x" * 40
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=4242,
                                  runs={long_name: script_run(tmp_path, "ok_run.py")},
                                  local_runs={"tiny": script_run(tmp_path, "ok_run.py")})
    r = cli("hosts", "--hosts", str(hosts))
    assert r.returncode == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("│ box"))
    assert f"ssh {sshd.user}@{sshd.host}:{sshd.port} -> pct 4242" in row and long_name in row, r.stdout
    assert len(row) > 80  # one line per host, not wrapped at 80 columns into a pipe
    assert any(ln.startswith("│ local") and "tiny" in ln for ln in r.stdout.splitlines())
    r = cli("logs", "box", long_name + "-typo", "--hosts", str(hosts))
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and len(err) > 120, err  # one error line, however long


def test_inventory_discovery_order_and_the_builtin_local_host_is_said(tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    home.mkdir()
    env = {"HOME": str(home)}
    r = cli("hosts", cwd=work, env=env)
    assert r.returncode == 0 and "│ local" in r.stdout and "built-in" in r.stdout, r
    assert "no hosts.yaml found" in r.stderr and "opsctl init" in r.stderr, r.stderr
    r = cli("status", "nope", cwd=work, env=env)
    assert r.returncode == 2 and "hosts.yaml:" not in r.stderr and "built-in inventory" in r.stderr, r.stderr

    def inventory_with(host: str, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({"hosts": {host: {"local": True}}}))
        return path

    inventory_with("from-user-config", home / ".config" / "opsctl" / "hosts.yaml")
    assert "from-user-config" in cli("hosts", cwd=work, env=env).stdout
    inventory_with("from-cwd", work / "hosts.yaml")
    assert "from-cwd" in cli("hosts", cwd=work, env=env).stdout
    env["OPSCTL_HOSTS"] = str(inventory_with("from-env", tmp_path / "env.yaml"))
    assert "from-env" in cli("hosts", cwd=work, env=env).stdout
    explicit = inventory_with("from-flag", tmp_path / "flag.yaml")
    out = cli("hosts", "--hosts", str(explicit), cwd=work, env=env)
    assert "from-flag" in out.stdout and "no hosts.yaml found" not in out.stderr
    r = cli("hosts", "--hosts", str(tmp_path / "missing.yaml"), cwd=work, env=env)
    assert r.returncode == 2 and "missing.yaml: file not found" in r.stderr


def test_init_writes_a_commented_inventory_that_loads_and_is_not_overwritten(tmp_path: Path) -> None:
    r = cli("init", cwd=tmp_path, env={"HOME": str(tmp_path)})
    assert r.returncode == 0 and "wrote" in r.stderr, r.stderr
    text = (tmp_path / "hosts.yaml").read_text()
    assert "#   pct: 200" in text and "#   ssh:" in text  # the SSH and pct examples, commented out
    inv = load_inventory(tmp_path / "hosts.yaml")
    assert list(inv.hosts) == ["local"] and list(inv.runs["local"]) == ["tiny"]
    # uncomment the example entries (keys and their continuation lines), not the prose around them
    example = re.compile(r"^  # (\s{2,}\S|\s*[\w.-]+:)")
    uncommented = "\n".join(ln.replace("  # ", "  ", 1) if example.match(ln) else ln for ln in text.splitlines())
    examples = yaml.safe_load(uncommented)["hosts"]
    assert examples["pve-box"]["pct"] == 200 and examples["gpu1"]["ssh"]["host"] == "gpu1.example.org"
    assert cli("hosts", "check", cwd=tmp_path, env={"HOME": str(tmp_path)}).returncode == 0
    r = cli("init", cwd=tmp_path)
    assert r.returncode == 2 and "exists; not overwritten" in r.stderr
    assert (tmp_path / "hosts.yaml").read_text() == text
    assert cli("init", "--force", str(tmp_path / "sub" / "h.yaml"), cwd=tmp_path).returncode == 0


def _complete(line: str, tmp_path: Path, extra_env: dict[str, str] | None = None) -> list[str]:
    out = tmp_path / "completions"
    env = {"_ARGCOMPLETE": "1", "COMP_LINE": line, "COMP_POINT": str(len(line)), "_ARGCOMPLETE_IFS": "\n",
           "_ARGCOMPLETE_STDOUT_FILENAME": str(out), **(extra_env or {})}
    r = cli(cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    return [c.strip() for c in out.read_text().split("\n")]  # a trailing space: the shell moves on


def test_shell_completion_of_verbs_options_hosts_and_runs(tmp_path: Path, sshd) -> None:
    r = cli("completion", "bash")
    assert r.returncode == 0 and "complete" in r.stdout and "opsctl" in r.stdout
    if shutil.which("bash"):  # the script is valid bash
        assert subprocess.run(["bash", "-n"], input=r.stdout, text=True).returncode == 0
    assert "compdef" in cli("completion", "zsh").stdout or "bashcompinit" in cli("completion", "zsh").stdout
    assert "status" in _complete("opsctl sta", tmp_path)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"qwen27b": script_run(tmp_path, "ok_run.py")},
                                  local_runs={"tiny": script_run(tmp_path, "ok_run.py")})
    assert _complete(f"opsctl --hosts {hosts} status b", tmp_path) == ["box"]
    assert _complete(f"opsctl logs --hosts {hosts} box q", tmp_path) == ["qwen27b"]
    assert sorted(_complete(f"opsctl --hosts {hosts} watch box", tmp_path)) == ["box", "box:qwen27b"]
    assert "--accept-new-host-key" in _complete("opsctl status box --acc", tmp_path)


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["export", "--help"], ["init", "--help"]])
def test_help_teaches_the_new_verbs(argv: list[str]) -> None:
    r = cli(*argv)
    assert r.returncode == 0 and "usage: opsctl" in r.stdout
    if argv == ["--help"]:
        assert "opsctl completion" in r.stdout and "~/.config/opsctl/hosts.yaml" in r.stdout
        assert "opsctl export" in r.stdout and "opsctl init" in r.stdout


# Every exit code each verb can return, read from its code paths (commands.py, history.py, export.py, group_verbs.py,
# the agent's verbs): a verb's --help may list only these. Kept here, apart from cli.VERB_EXIT_CODES, so a code
# added to a verb's help that the verb cannot return fails this test.
VERB_CODES = {
    "launch": {0, 1, 2, 3, 4, 5, 6}, "history": {0, 1, 2, 3, 5}, "status": {0, 2, 3, 5}, "logs": {0, 1, 2, 3, 5},
    "kill": {0, 1, 2, 3, 5}, "clean": {0, 2, 3, 5}, "watch": {0, 2, 3}, "export": {0, 2, 3, 5}, "hosts": {0, 2},
    "init": {0, 2}, "completion": {0, 2},
}


def _listed_codes(help_text: str) -> list[int]:
    """The codes of the `exit codes:` section (each line `  N  meaning`; continuation lines are indented more)."""
    section = help_text.split("\nexit codes:\n", 1)[1]
    return [int(m.group(1)) for m in re.finditer(r"^  (\d+)  \S", section, re.M)]


@pytest.mark.parametrize("verb", sorted(VERB_CODES))
def test_each_verbs_help_lists_only_the_exit_codes_it_can_return(verb: str) -> None:
    r = cli(verb, "--help")
    assert r.returncode == 0, r.stderr
    assert "\nexit codes:\n" in r.stdout, f"opsctl {verb} --help has no exit-code section"
    codes = _listed_codes(r.stdout)
    assert codes and set(codes) <= VERB_CODES[verb] and 0 in codes and 2 in codes, (verb, codes)
    assert len(codes) == len(set(codes))
    if verb not in ("launch",):  # the group supervision codes belong to launch alone
        assert 4 not in codes and 6 not in codes, (verb, codes)
    assert r.stdout.count("exit codes") == 1  # one section, not the old 17-line block pasted in


def test_logs_help_has_an_exit_code_section_with_follows_failure() -> None:
    codes = _listed_codes(cli("logs", "--help").stdout)
    assert 1 in codes and 3 in codes  # -f: the run failed; the link lost for good


def test_watch_help_describes_the_dashboard_and_lists_every_key_binding() -> None:
    from opsctl.tui import WatchApp
    from opsctl.widgets import LogPane

    r = cli("watch", "--help")
    assert r.returncode == 0, r.stderr
    head = r.stdout.split("positional arguments:")[0]
    assert "dashboard" in head  # a description, not only the usage line
    keys = r.stdout.split("\nkeys:\n", 1)[1].split("\n\n", 1)[0]
    listed = {k for line in keys.splitlines() for k in line.split("  ", 2)[1].split()}
    names = {"slash": "/", "escape": "esc"}
    for b in [*WatchApp.BINDINGS, *LogPane.BINDINGS]:
        for k in b.key.split(","):
            assert names.get(k, k) in listed, (k, keys)
    assert {"m", "e", "g", "v", "ctrl+s", "q"} <= listed


def test_positionals_and_follow_are_documented() -> None:
    for verb in ("launch", "logs", "kill", "history", "export", "clean", "status"):
        out = cli(verb, "--help").stdout
        args = out.split("positional arguments:\n", 1)[1].split("\n\n", 1)[0]
        assert re.search(r"^  HOST +\S", args, re.M) and re.search(r"^  RUN +\S", args, re.M), (verb, args)
    logs = cli("logs", "--help").stdout
    assert re.search(r"-f, --follow +\S", logs), logs


def test_launch_without_arguments_says_what_launch_needs() -> None:
    r = cli("launch")
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()[-1]
    assert "launch needs HOST and RUN" in err and "hosts.yaml" in err and "opsctl launch local tiny" in err, err
    assert "-- ARGS" not in err and "required" not in err
    assert "Traceback" not in r.stderr


def test_top_level_help_has_one_example_per_verb() -> None:
    out = cli("--help").stdout
    examples = out.split("examples:\n", 1)[1].split("\n\n", 1)[0]
    for verb in ("launch", "status", "logs", "kill", "clean", "history", "watch", "export", "hosts", "init"):
        assert re.search(rf"^  opsctl {verb}\b", examples, re.M), verb
