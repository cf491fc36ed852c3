"""`./dev` itself, run as a real script on a copy of its entry files with a real (pip-less) virtualenv of its own.

z-lab's PyPI package is also named `dflash` (same import name as ours, installed as dflash-ops): `./dev` warns in
one line when its venv holds that package's files, and stays quiet otherwise (issue 39 item 5).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _dev_copy(tmp: Path) -> tuple[Path, Path, Path]:
    """(the copy's dir, its venv, the venv's site-packages): the venv counts as set up (stamp newer than pyproject)."""
    d = tmp / "repo"
    d.mkdir()
    for name in ("dev", "pyproject.toml"):
        shutil.copy2(REPO / name, d / name)
    venv = d / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    stamp = venv / ".dflash-installed"
    stamp.touch()
    old = stamp.stat().st_mtime - 10
    os.utime(d / "pyproject.toml", (old, old))
    rel = Path(sysconfig.get_paths()["purelib"]).relative_to(sysconfig.get_paths()["data"])
    site = venv / rel
    assert site.is_dir(), site
    return d, venv, site


def _dev(d: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_VENV"}
    return subprocess.run(["./dev"], cwd=d, capture_output=True, text=True, timeout=120, env=env)


def test_dev_warns_when_its_venv_holds_z_labs_dflash_package(tmp_path: Path) -> None:
    d, venv, site = _dev_copy(tmp_path)
    (site / "dflash_ops-0.1.0.dist-info").mkdir()  # ours: no warning
    quiet = _dev(d)
    assert quiet.returncode == 2 and "usage: ./dev" in quiet.stderr and "warning" not in quiet.stderr
    other = site / "dflash-0.1.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: dflash\nVersion: 0.1.0\n")
    (site / "dflash").mkdir()
    (site / "dflash" / "__init__.py").write_text("")
    r = _dev(d)
    assert r.returncode == 2
    (line,) = [x for x in r.stderr.splitlines() if "warning" in x]
    assert line.startswith("== warning: .venv holds another package named dflash (z-lab's")
    assert str(other) in line and str(site / "dflash") in line and "pip uninstall dflash" in line
