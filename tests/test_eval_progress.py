"""`dflash eval` says how far it is (issue 25 items 7, 8), through real `python -m dflash eval` processes.

A pipe or file gets plain progress lines on stderr, one per finished prompt batch, for both methods; a terminal gets a
rich progress bar (a real pty); stdout stays the table or one JSON object, and a pipe never wraps it at 80 columns.
The table and its summary name acceptance (tau) and wall-clock speed separately.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
from dflash_fixtures import run_config

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--num-prompts", "2", "--prompt-tokens", "12", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dflash.train import train

    out = tmp_path_factory.mktemp("run")
    assert train(run_config(train={"max_steps": 2, "checkpoint_every": 0}), out).exit_code == 0
    return out / "checkpoints" / "step-2"


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "COLUMNS": "80", **extra}  # a narrow COLUMNS must not narrow a pipe's output


def progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dflash eval: ")]


def test_teacher_forced_json_on_a_pipe_progress_lines_on_stderr(checkpoint: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "dflash", "eval", "--checkpoint", str(checkpoint), *SMALL, "--json",
                        "--baseline", "ngram"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["method"] == "teacher-forced"  # stdout: exactly one JSON object, nothing else
    lines = progress_lines(r.stderr)
    for phase in ("target greedy continuations", "drafter pass (teacher-forced)"):
        done = [x for x in lines if x.startswith(f"dflash eval: {phase}: 2/2 prompts, ")]
        assert len(done) == 1 and re.search(r", [\d,]+ tokens/s, done in [\d.]+ s$", done[0]), lines
    assert "\x1b[" not in r.stderr  # no terminal control codes in a log


def test_decode_on_a_pipe_progress_per_prompt_and_an_unwrapped_table(checkpoint: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "dflash", "eval", "--checkpoint", str(checkpoint), *SMALL,
                        "--method", "decode", "--baseline", "ngram"],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = progress_lines(r.stderr)
    for phase in ("target greedy (reference)", "decode: dflash + n-gram",
                  "training-path accuracy"):
        ours = [x for x in lines if x.startswith(f"dflash eval: {phase}: ")]
        assert ours and ours[-1].startswith(f"dflash eval: {phase}: 2/2 prompts, ") and "done in" in ours[-1], lines
    out = r.stdout.splitlines()
    # Acceptance and speed: separate, named columns and separate summary lines, each whole on one line.
    header = next(x for x in out if "method" in x)
    assert "acceptance τ (tokens/verify step)" in header and "speed (tokens/s, decode loop)" in header
    assert len(header) > 80
    acc = [x for x in out if x.startswith("acceptance τ (tokens per target verify step), 95 % interval")]
    assert len(acc) == 1 and re.search(r"τ ratio dflash / n-gram [\d.]+x \([\d.]+-[\d.]+\): acceptance per step, "
                                       r"not speed$", acc[0]), out
    speed = [x for x in out if x.startswith("wall-clock speed (tokens/s of the decode loop): target greedy ")]
    assert len(speed) == 1 and re.search(r"n-gram [\d.]+ \([\d.]+x target\); fastest: (target greedy|dflash|n-gram)$",
                                         speed[0]), out
    assert any(x.startswith("accepted: share of steps") and x.endswith("serving and training differ)") for x in out)


def test_a_target_loaded_from_a_directory_on_a_pipe_is_one_line_not_a_carriage_return_bar(checkpoint: Path,
                                                                                             tmp_path: Path) -> None:
    """--target DIR loads through transformers' from_pretrained, whose `Loading weights` tqdm bar on a pipe would be
    one long line of `\r` redraws in a log; there it is one plain line instead (a terminal keeps the bar)."""
    import torch

    from dflash.target import Target

    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 0})
    Target(cfg.target, cfg.drafter.num_layers, torch.device("cpu")).model.save_pretrained(tmp_path / "target")
    r = subprocess.run([sys.executable, "-m", "dflash", "eval", "--checkpoint", str(checkpoint), "--target",
                        str(tmp_path / "target"), *SMALL, "--json"],
                       cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Loading weights" not in r.stderr and "\r" not in r.stderr, r.stderr
    loaded = [x for x in progress_lines(r.stderr) if x.endswith(" s") and " loaded in " in x]
    assert len(loaded) == 1 and re.fullmatch(rf"dflash eval: target {re.escape(str(tmp_path / 'target'))} loaded in "
                                             r"[\d.]+ s", loaded[0]), r.stderr
    assert json.loads(r.stdout)["method"] == "teacher-forced"


def test_progress_bar_on_a_terminal_and_json_still_parses(checkpoint: Path) -> None:
    """stderr is a real 80-column pty: rich draws its bar there, nothing cut; stdout (a pipe) is one JSON object."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "eval", "--checkpoint", str(checkpoint), *SMALL,
                             "--json"], cwd=REPO, env={**env(TERM="xterm-256color"), "COLUMNS": ""}, stdout=subprocess.PIPE,
                            stderr=slave, text=True)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # keep the pty from filling while rich redraws
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        stdout, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
        os.close(master)
    tty = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, tty[-3000:]
    assert json.loads(stdout)["method"] == "teacher-forced"
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tty)
    final = [x.rsplit("\r", 1)[-1] for x in plain.splitlines() if x.strip()][-2:]  # each bar's last redraw
    assert final[0].startswith("target greedy continuations ") and final[1].startswith("drafter pass (teacher-forced) ")
    for bar in final:
        assert re.search(r"━+ 2/2 prompts  [\d,]+ tokens/s  eta", bar) and "…" not in bar, final
    assert len(plain) > 0 and "dflash eval: " not in plain  # rich's bar, not the plain lines of a pipe
    assert "dflash eval: target greedy" not in plain
