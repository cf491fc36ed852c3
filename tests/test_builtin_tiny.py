"""The built-in inventory (no hosts.yaml anywhere) and `opsctl init` outside the checkout, from an installed package.

Both used to read `configs/tiny.yaml` relative to the current directory or the repository, so from an installed
package the `local tiny` run could not start. The config now ships as package data (dflash/configs/tiny.yaml, a link
to configs/tiny.yaml in the checkout, a file in the wheel). Real processes: a wheel built from this tree, installed
into a directory of its own, and the CLI run from a directory that is not the checkout, with no hosts.yaml around.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import REPO, build_tiny_default, kill_tmux  # noqa: E402

from opsctl.config import builtin_tiny_config, load_inventory, resolve  # noqa: E402


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dflash + opsctl as a wheel installs them (no editable links back to the checkout): a directory for PYTHONPATH.

    Built from a copy of the sources so the build's own files (build/, *.egg-info) never land in the checkout."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("dflash", "opsctl", "configs"):
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(base / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (base / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:  # the link is followed: the wheel holds the file itself, same bytes
        assert z.read("dflash/configs/tiny.yaml") == (REPO / "configs" / "tiny.yaml").read_bytes()
        # the fla configs dflash ships (package data): an installed dflash seeds a fresh host's store from them
        seed = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "dflash" / "fla_seed").glob("*/*/*.json"))
        assert seed and set(seed) <= set(z.namelist()), (seed, z.namelist())
    target = base / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.rmtree(src)  # nothing of the checkout's tree is left for the installed copy to lean on
    return target


def cli(cwd: Path, site: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """opsctl from the installed copy, in a directory with no hosts.yaml (nor a ~/.config/opsctl/hosts.yaml)."""
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb", XDG_CONFIG_HOME=str(cwd / ".config"),
               PYTHONPATH=str(site))
    env.pop("OPSCTL_HOSTS", None)
    return subprocess.run([sys.executable, "-m", "opsctl", *argv], cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_the_packaged_tiny_config_is_the_repository_file_not_a_copy() -> None:
    """One source: in the checkout the package's config is configs/tiny.yaml itself (a link), never a duplicate that
    could drift; the built-in inventory points the run at it by absolute path."""
    path = builtin_tiny_config()
    assert path is not None and path.is_absolute() and path.parts[-3:] == ("dflash", "configs", "tiny.yaml")
    assert path.resolve() == (REPO / "configs" / "tiny.yaml").resolve()


def test_builtin_inventory_points_the_tiny_run_at_the_packaged_config(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / ".config"))
    monkeypatch.delenv("OPSCTL_HOSTS", raising=False)
    _, run = resolve(load_inventory(None), "local", "tiny")
    assert run is not None
    config = run.command[run.command.index("--config") + 1]
    assert config == str(builtin_tiny_config()) and Path(config).is_file()


def test_builtin_tiny_run_starts_from_an_installed_package_outside_the_checkout(tmp_path: Path,
                                                                                installed: Path) -> None:
    """`opsctl hosts` and `opsctl launch local tiny` with the built-in inventory, from a directory that is not the
    checkout and an opsctl that is not the checkout's: preflight passes (the config exists) and the run reaches
    READY; it is killed right after."""
    build_tiny_default()  # the tiny target and records in the shared cache: the launch measures launching
    home = tmp_path / "elsewhere"
    home.mkdir()
    assert REPO not in home.parents
    where = subprocess.run([sys.executable, "-c", "import dflash, opsctl; print(dflash.__file__, opsctl.__file__)"],
                           cwd=str(home), capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(installed)))
    assert where.stdout.split() == [str(installed / "dflash" / "__init__.py"), str(installed / "opsctl" / "__init__.py")]

    r = cli(home, installed, "hosts")
    assert r.returncode == 0, r.stderr
    assert "built-in inventory" in r.stdout and "local" in r.stdout and "tiny" in r.stdout, r.stdout
    assert "no hosts.yaml found" in r.stderr  # never silently
    try:
        r = cli(home, installed, "launch", "local", "tiny")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "FAIL" not in r.stderr and "READY tiny: first step event" in r.stderr, r.stderr
        (st,) = json.loads(cli(home, installed, "status", "local", "tiny", "--json").stdout)
        assert st["state"] == "training" and st["exception"] is None, st
        assert (home / "runs" / "tiny" / "events.jsonl").is_file()  # the run's files in the directory it ran from
    finally:
        cli(home, installed, "kill", "local", "tiny")
        kill_tmux(home, "tiny")


def test_init_outside_the_checkout_copies_the_packaged_config(tmp_path: Path, installed: Path) -> None:
    home = tmp_path / "newcomer"
    home.mkdir()
    r = cli(home, installed, "init")
    assert r.returncode == 0, r.stderr
    assert f"wrote {home / 'tiny.yaml'}" in r.stderr and str(installed / "dflash" / "configs" / "tiny.yaml") in r.stderr
    assert (home / "tiny.yaml").read_bytes() == (REPO / "configs" / "tiny.yaml").read_bytes()
    assert cli(home, installed, "hosts", "check").returncode == 0
