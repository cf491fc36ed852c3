"""hosts.yaml validation: every error names file:line and the field path; defaults and paths resolve as documented.

The point is that a typo in hosts.yaml costs seconds, and that dangerous values never get past loading.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from opsctl.config import (
    InventoryError,
    builtin_tiny_config,
    check_inventory,
    dangerous_path_reason,
    default_hosts_yaml,
    load_inventory,
    parse_inventory,
    path_is_within,
    resolve,
)

REPO = Path(__file__).resolve().parent.parent


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line containing `needle` (so tests never hard-code line numbers)."""
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in text")


def errors_of(text: str, file: str = "hosts.yaml") -> list[str]:
    with pytest.raises(InventoryError) as ei:
        parse_inventory(text, file=file, base_dir="/srv/x")
    return str(ei.value).splitlines()


GOOD_SSH = textwrap.dedent("""\
    hosts:
      gpu1:
        ssh:
          host: gpu1.example.org
          user: ml
        runs:
          train:
            workdir: /home/ml/work
            command: [python3, -m, dflash, train]
            log: runs/a/train.log
    """)


def test_embedded_default_loads_without_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPSCTL_HOSTS", raising=False)
    inv = load_inventory(None)
    host, run = resolve(inv, "local", "tiny")
    assert host.local and host.kind == "local"
    assert run is not None
    assert run.workdir == str(tmp_path.resolve())
    assert run.command[0] == sys.executable  # {python} -> the interpreter running opsctl, for local hosts
    # the config shipped in the dflash package, by absolute path: the run starts from any directory
    assert run.command[1:] == ["-m", "dflash", "train", "--config", str(builtin_tiny_config()), "--out", "runs/tiny",
                              "--resume", "auto"]
    assert run.log == str(tmp_path.resolve() / "runs/tiny/train.log")
    assert run.events == str(tmp_path.resolve() / "runs/tiny/events.jsonl")
    assert run.tmux_session == "dflash-tiny"
    assert run.state_dir == str(tmp_path.resolve() / ".opsctl/tiny")


def test_shipped_hosts_yaml_defines_the_embedded_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    shipped = load_inventory(REPO / "hosts.yaml")
    embedded = parse_inventory(default_hosts_yaml(), base_dir=REPO)
    # the same run, but for --config: the repository's relative configs/tiny.yaml vs the packaged one by absolute
    # path, which in a checkout is that very file (a link)
    ship, emb = shipped.runs["local"]["tiny"], embedded.runs["local"]["tiny"]
    at = ship.command.index("--config") + 1
    assert (REPO / ship.command[at]).resolve() == Path(emb.command[at]).resolve()
    assert ship.model_copy(update={"command": emb.command}) == emb
    assert shipped.hosts["local"] == embedded.hosts["local"]
    assert check_inventory(REPO / "hosts.yaml") == []
    # None -> ./hosts.yaml when it exists
    assert load_inventory(None).path == str((REPO / "hosts.yaml").resolve())


def test_commented_examples_in_shipped_hosts_yaml_are_valid() -> None:
    text = (REPO / "hosts.yaml").read_text()
    body = text[text.index("\nhosts:\n"):]
    lines = []
    for line in body.splitlines():
        m = re.match(r"^  # ?(.*)$", line)
        if m and (re.match(r"[a-z0-9-]+:", m.group(1)) or m.group(1).startswith(" ")):
            lines.append("  " + m.group(1))
        elif not line.lstrip().startswith("#"):
            lines.append(line)
    inv = parse_inventory("\n".join(lines), base_dir=REPO)
    assert set(inv.hosts) == {"local", "gpu1", "pve-box"}
    pve = inv.hosts["pve-box"]
    assert pve.kind == "ssh+pct" and pve.pct == 200 and pve.ssh is not None and pve.ssh.jump == "bastion.example.org"
    run = inv.runs["pve-box"]["qwen27b"]
    assert run.model_manifest == "/dev/shm/Qwen3.6-27B/manifest.json"
    assert run.inductor_cache_dir == "/workspace/dflash-ops/.opsctl/qwen27b/inductor"  # per run: <state_dir>/inductor
    assert run.kill_grace == [60.0, 20.0]
    assert inv.runs["gpu1"]["drafter"].inductor_cache_dir == "/home/ml/dflash-ops/.opsctl/drafter/inductor"


def test_wrong_type_names_file_line_and_field() -> None:
    text = GOOD_SSH.replace("user: ml", "user: ml\n      port: abc")
    errs = errors_of(text, file="conf/hosts.yaml")
    assert errs == [f"conf/hosts.yaml:{line_of(text, 'port: abc')}: hosts.gpu1.ssh.port: "
                    "Input should be a valid integer, unable to parse string as an integer"]


def test_unknown_key_is_refused_with_a_suggestion() -> None:
    text = GOOD_SSH.replace("log: runs/a/train.log", "log: runs/a/train.log\n        ready_timout: 30")
    errs = errors_of(text)
    assert errs == [f"hosts.yaml:{line_of(text, 'ready_timout')}: hosts.gpu1.runs.train.ready_timout: "
                    "unknown key 'ready_timout' (did you mean 'ready_timeout'?)"]


def test_runs_share_settings_through_x_anchors_and_merges_and_aliased_runs_keep_their_names() -> None:
    text = textwrap.dedent("""\
        x-run: &run
          workdir: /home/ml/work
          command: [python3, -m, dflash, train]
          log: runs/b/train.log
          ready_timeout: 900
        hosts:
          gpu1:
            ssh: {host: gpu1.example.org, user: ml}
            runs:
              a:
                <<: *run
                ready_timeout: 60
                log: runs/a/train.log
              b: *run
              c:
                <<: *run
                log: runs/c/train.log
        """)
    runs = parse_inventory(text, file="hosts.yaml", base_dir="/srv/x").runs["gpu1"]
    assert {n: (r.name, r.ready_timeout, r.workdir) for n, r in runs.items()} == {
        "a": ("a", 60, "/home/ml/work"), "b": ("b", 900, "/home/ml/work"), "c": ("c", 900, "/home/ml/work")}
    assert {r.tmux_session for r in runs.values()} == {"dflash-a", "dflash-b", "dflash-c"}
    # only the x- prefix is free: any other unknown top-level key is still a typo
    errs = errors_of(text.replace("x-run:", "defaults:"))
    assert errs == ["hosts.yaml:1: defaults: unknown key 'defaults'"]
    # an unknown key merged in is refused where the run uses it
    errs = errors_of(text.replace("  ready_timeout: 900", "  ready_timout: 900"))
    assert errs[0].startswith(f"hosts.yaml:{line_of(text, 'a:')}: hosts.gpu1.runs.a.ready_timout: unknown key"), errs


def test_missing_required_field_points_at_its_parent() -> None:
    text = GOOD_SSH.replace("        log: runs/a/train.log\n", "")
    errs = errors_of(text)
    assert errs == [f"hosts.yaml:{line_of(text, 'train:')}: hosts.gpu1.runs.train.log: missing required field 'log'"]


@pytest.mark.parametrize("vmid, msg", [
    ("5", "a Proxmox VMID is an integer in 100..999999999, got 5"),
    ("1000000000", "a Proxmox VMID is an integer in 100..999999999, got 1000000000"),
    ("ct200", "Input should be a valid integer, unable to parse string as an integer"),
])
def test_bad_pct_vmid(vmid: str, msg: str) -> None:
    text = GOOD_SSH.replace("        runs:", f"        pct: {vmid}\n        runs:").replace("    runs:", f"    pct: {vmid}\n    runs:", 1)
    errs = errors_of(text)
    assert errs == [f"hosts.yaml:{line_of(text, 'pct:')}: hosts.gpu1.pct: {msg}"]


@pytest.mark.parametrize("root, why", [
    ("/", "'/' is never cleaned"),
    ("~/cache", "starts with '~'"),
    ("cache", "is not absolute"),
    ("/usr", "system directory"),
    ("/tmp", "system directory"),
    ("/data", "top-level directory"),
    ("/tmp/../etc", "'..'"),
    ('""', "empty path"),
])
def test_dangerous_clean_roots_are_refused(root: str, why: str) -> None:
    text = GOOD_SSH + f"        clean_roots: [/home/ml/work/.opsctl/train/inductor, {root}]\n"
    errs = errors_of(text)
    assert len(errs) == 1
    assert errs[0].startswith(f"hosts.yaml:{line_of(text, 'clean_roots')}: hosts.gpu1.runs.train.clean_roots.1: refusing clean root:")
    assert why in errs[0]


def test_inductor_cache_dir_must_be_safe_and_inside_clean_roots() -> None:
    text = GOOD_SSH + "        inductor_cache_dir: /var\n"
    (err,) = errors_of(text)
    assert err.startswith(f"hosts.yaml:{line_of(text, 'inductor_cache_dir')}: hosts.gpu1.runs.train.inductor_cache_dir: refusing")
    text = GOOD_SSH + "        inductor_cache_dir: /scratch/ind\n        clean_roots: [/scratch/other]\n"
    (err,) = errors_of(text)
    assert "is not inside any of clean_roots" in err
    ok = parse_inventory(GOOD_SSH + "        inductor_cache_dir: /scratch/ind/x\n        clean_roots: [/scratch/ind]\n")
    assert ok.runs["gpu1"]["train"].inductor_cache_dir == "/scratch/ind/x"


def test_several_problems_are_all_reported_with_their_lines() -> None:
    text = textwrap.dedent("""\
        hosts:
          a:
            ssh: {host: h1, port: 70000}
          b:
            local: true
            gpus: [0, 0]
        """)
    errs = errors_of(text)
    assert errs == [
        f"hosts.yaml:{line_of(text, 'port: 70000')}: hosts.a.ssh.port: Input should be less than or equal to 65535",
        f"hosts.yaml:{line_of(text, 'gpus')}: hosts.b.gpus: GPU indices must be unique",
    ]


def test_host_must_be_local_xor_ssh() -> None:
    (err,) = errors_of("hosts:\n  a:\n    python: python3\n")
    assert err == "hosts.yaml:2: hosts.a: set `local: true` or give `ssh:` settings (at least `host:`)"
    (err,) = errors_of("hosts:\n  a:\n    local: true\n    ssh: {host: x}\n")
    assert "either `local: true` or has `ssh:`" in err


def test_remote_workdir_must_be_absolute() -> None:
    text = GOOD_SSH.replace("workdir: /home/ml/work", "workdir: work")
    (err,) = errors_of(text)
    assert err == (f"hosts.yaml:{line_of(text, 'workdir')}: hosts.gpu1.runs.train.workdir: "
                   "'work': a remote (ssh or pct) workdir must be an absolute path")
    text = GOOD_SSH.replace("log: runs/a/train.log", "log: ~/train.log")
    (err,) = errors_of(text)
    assert err == (f"hosts.yaml:{line_of(text, 'log:')}: hosts.gpu1.runs.train.log: "
                   "'~/train.log': '~' cannot be resolved for a remote host; write an absolute path")


def test_duplicate_keys_and_bad_yaml_name_their_line() -> None:
    text = GOOD_SSH.replace("user: ml", "user: ml\n      user: root")
    (err,) = errors_of(text)
    assert err == f"hosts.yaml:{line_of(text, 'user: root')}: hosts.gpu1.ssh.user: duplicate key"
    (err,) = errors_of("hosts:\n  a: [unclosed\n")
    assert err.startswith("hosts.yaml:2: not valid YAML")  # the line with the open '[', not the one after it


def test_yaml_syntax_errors_name_the_line_to_fix() -> None:
    text = GOOD_SSH.replace("user: ml", "user: [ml")
    (err,) = errors_of(text)
    assert err.startswith(f"hosts.yaml:{line_of(text, 'user: [ml')}: not valid YAML: ")
    assert "(a '[' list opened on this line is not closed)" in err
    text = GOOD_SSH.replace("user: ml", "user ml")  # the missing ':' is noticed on the next key's line
    (err,) = errors_of(text)
    assert err.startswith(f"hosts.yaml:{line_of(text, 'user ml')}: not valid YAML: could not find expected ':'")


def test_exponent_numbers_without_a_dot_are_numbers() -> None:
    """YAML 1.1 reads `1e3` as a string; hosts.yaml accepts it as a number, like the dflash configs do."""
    text = GOOD_SSH.replace("user: ml", "user: ml\n      connect_timeout: 3e1").replace(
        "log: runs/a/train.log", "log: runs/a/train.log\n        ready_timeout: 1e3")
    inv = parse_inventory(text)
    assert inv.hosts["gpu1"].ssh is not None and inv.hosts["gpu1"].ssh.connect_timeout == 30.0
    assert inv.runs["gpu1"]["train"].ready_timeout == 1000.0


def test_hostile_names_and_env_keys_are_refused() -> None:
    (err,) = errors_of(GOOD_SSH.replace("gpu1:", "'gpu1; rm -rf /':"))
    assert "host names use letters" in err
    (err,) = errors_of(GOOD_SSH + "        env: {'A B': x}\n")
    assert "environment variable name 'A B'" in err
    (err,) = errors_of(GOOD_SSH + "        tmux_session: 'a:b'\n")
    assert "tmux session name" in err
    (err,) = errors_of(GOOD_SSH.replace("host: gpu1.example.org", "host: -oProxyCommand=x"))
    assert "must not start with '-'" in err
    (err,) = errors_of(GOOD_SSH.replace("[python3, -m,", '[python3, "a\\0b", -m,'))
    assert err.endswith("hosts.gpu1.runs.train: command contains a NUL byte")


def test_values_are_kept_verbatim_and_env_numbers_become_text() -> None:
    hostile = "$(touch /tmp/pwned); `id` * 'q' \"d\""
    text = GOOD_SSH + f"        env: {{OMP_NUM_THREADS: 4, WEIRD: {json.dumps(hostile)}}}\n"
    run = parse_inventory(text).runs["gpu1"]["train"]
    assert run.env == {"OMP_NUM_THREADS": "4", "WEIRD": hostile}
    (err,) = errors_of(GOOD_SSH + "        env: {FLAG: true}\n")
    assert "booleans are ambiguous" in err


def test_defaults_follow_the_documented_rules() -> None:
    inv = parse_inventory(GOOD_SSH + "        env: {TORCHINDUCTOR_CACHE_DIR: cache/ind}\n"
                          "        clean_roots: [/home/ml/work/cache]\n")
    run = inv.runs["gpu1"]["train"]
    assert run.inductor_cache_dir == "/home/ml/work/cache/ind"  # $TORCHINDUCTOR_CACHE_DIR, relative to workdir
    assert run.log == "/home/ml/work/runs/a/train.log"
    assert run.events is None
    assert run.tmux_session == "dflash-train"
    assert run.state_dir == "/home/ml/work/.opsctl/train"
    assert run.kill_grace == [10.0, 10.0] and run.ready_timeout == 600.0
    plain = parse_inventory(GOOD_SSH).runs["gpu1"]["train"]
    cache = "/home/ml/work/.opsctl/train/inductor"  # per run, under its state_dir (issue 8 item 2)
    assert plain.inductor_cache_dir == cache and plain.clean_roots == [cache]


def test_script_command_runs_under_bash_and_python_placeholder_uses_host_python() -> None:
    text = GOOD_SSH.replace("command: [python3, -m, dflash, train]", "command: 'cd x && ./run.sh'")
    assert parse_inventory(text).runs["gpu1"]["train"].argv == ["bash", "-c", "cd x && ./run.sh"]
    text = GOOD_SSH.replace("command: [python3,", "command: ['{python}',").replace("    runs:", "    python: /opt/py/bin/python3\n    runs:", 1)
    assert parse_inventory(text).runs["gpu1"]["train"].argv[0] == "/opt/py/bin/python3"
    (err,) = errors_of(GOOD_SSH.replace("command: [python3, -m, dflash, train]", "command: 5"))
    assert err.endswith("hosts.gpu1.runs.train.command: expected an argv list of strings or a script string")


def test_relative_paths_resolve_against_the_hosts_file_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "conf"
    d.mkdir()
    (d / "hosts.yaml").write_text("hosts:\n  local:\n    local: true\n    runs:\n      r:\n        workdir: ../proj\n"
                                  "        command: [echo]\n        log: out/x.log\n")
    monkeypatch.chdir("/")
    run = load_inventory(d / "hosts.yaml").runs["local"]["r"]
    assert run.workdir == str(tmp_path.resolve() / "proj")
    assert run.log == str(tmp_path.resolve() / "proj/out/x.log")


def test_typos_in_host_and_run_suggest_the_right_name() -> None:
    inv = parse_inventory(GOOD_SSH + "  local:\n    local: true\n")
    with pytest.raises(InventoryError) as ei:
        resolve(inv, "gpu", None)
    assert "unknown host 'gpu' (did you mean 'gpu1'?); known hosts: gpu1, local" in str(ei.value)
    with pytest.raises(InventoryError) as ei:
        resolve(inv, "gpu1", "trian")
    assert "hosts.gpu1.runs: unknown run 'trian' (did you mean 'train'?); known runs: train" in str(ei.value)
    host, run = resolve(inv, "gpu1", "train")
    assert host.name == "gpu1" and run is not None and run.name == "train"
    assert resolve(inv, "local", None) == (inv.hosts["local"], None)


def test_check_inventory_lists_problems_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "hosts.yaml"
    p.write_text(GOOD_SSH.replace("port", "x").replace("user: ml", "usr: ml"))
    problems = check_inventory(p)
    assert problems == [f"{p}:5: hosts.gpu1.ssh.usr: unknown key 'usr' (did you mean 'user'?)"]
    assert check_inventory(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: file not found"]


def test_jump_naming_an_inventory_host_must_be_an_ssh_host() -> None:
    text = GOOD_SSH.replace("user: ml", "user: ml\n      jump: local") + "  local:\n    local: true\n"
    (err,) = errors_of(text)
    assert "hosts.gpu1.ssh.jump: jump host 'local' must be another host with `ssh:` settings" in err


def test_path_helpers() -> None:
    assert dangerous_path_reason("/tmp/torchinductor_root") is None
    assert dangerous_path_reason("/dev/shm") is not None
    assert dangerous_path_reason("/dev/shm/cache") is None
    assert path_is_within("/a/b/c", "/a/b") and path_is_within("/a/b", "/a/b/")
    assert not path_is_within("/a/bc", "/a/b")


def test_a_key_at_the_wrong_level_says_where_it_belongs(tmp_path: Path) -> None:
    """`workdir:` one indent too far left sits under the host: "did you mean 'workdir'?" named the key itself."""
    p = tmp_path / "hosts.yaml"
    p.write_text("hosts:\n  box:\n    local: true\n    workdir: /srv\n    runs:\n      r:\n        command: [\"true\"]\n"
                 "        workdir: /srv\n        log: /srv/r.log\n        user: ml\n")
    assert sorted(check_inventory(p)) == [
        f"{p}:10: hosts.box.runs.r.user: unknown key 'user' here: 'user' belongs to a host's `ssh:`; check its "
        "indentation",
        f"{p}:4: hosts.box.workdir: unknown key 'workdir' here: 'workdir' belongs to a run (under `runs: NAME:`); "
        "check its indentation"]
    # at the top level `host:` is `hosts:` misspelt (it said: belongs to a host's `ssh:`)
    p.write_text("host:\n  box:\n    local: true\n")
    assert check_inventory(p)[-1] == f"{p}:1: host: unknown key 'host' (did you mean 'hosts'?)"


def test_two_runs_of_one_host_writing_one_log_or_events_file_are_refused() -> None:
    """Each launch rotates its run's log (LOG -> LOG.1) and every verb folds the events file as this run's: a second
    run entry pointing at the same files rotated the other's log away and read its steps as its own."""
    text = textwrap.dedent("""\
        hosts:
          gpu1:
            ssh: {host: gpu1.example.org}
            runs:
              a:
                workdir: /w
                command: [python3, -m, dflash, train]
                log: runs/a/train.log
                events: runs/a/events.jsonl
              b:
                workdir: /w
                command: [python3, -m, dflash, train, --resume, auto]
                log: /w/runs/a/./train.log
                events: runs/a/events.jsonl
              c:
                workdir: /w
                command: [python3, -m, dflash, train]
                log: runs/c/train.log
                events: runs/c/events.jsonl
          gpu2:
            ssh: {host: gpu2.example.org}
            runs:
              a: {workdir: /w, command: [python3, train.py], log: runs/a/train.log, events: runs/a/events.jsonl}
        """)
    errs = errors_of(text)
    assert errs == [
        f"hosts.yaml:{line_of(text, 'log: /w/runs/a/./train.log')}: hosts.gpu1.runs.b.log: /w/runs/a/train.log is "
        "also the log file of run 'a' on host gpu1 (hosts.gpu1.runs.a): give each run its own",
        f"hosts.yaml:{line_of(text, 'log: /w/runs/a/./train.log') + 1}: hosts.gpu1.runs.b.events: "
        "/w/runs/a/events.jsonl is also the events file of run 'a' on host gpu1 (hosts.gpu1.runs.a): give each run "
        "its own",
    ]  # run c has its own files, and gpu2's run a is another machine's


def test_a_hosts_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "hosts.yaml"
    p.write_bytes(GOOD_SSH.encode().replace(b"user: ml", b"user: m\xe9l"))
    with pytest.raises(InventoryError) as ei:
        load_inventory(p)
    assert str(ei.value) == (f"{p}:{line_of(GOOD_SSH, 'user: ml')}: not UTF-8 text (byte 0xe9 at offset "
                             f"{GOOD_SSH.index('user: ml') + 7}); save the file as UTF-8")
