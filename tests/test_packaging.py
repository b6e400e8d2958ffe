"""A wheel built from this checkout carries the catalog and runs from anywhere.

`pip install .` (or `pip install git+...`) installs the package alone: before setup.py's hook the installed piper
looked for models/ beside site-packages and every command said "models does not exist". The wheel is built from a
copy of the source (pip builds in the tree it is given) and installed with pip into a folder of its own; piper then
runs from another directory, with no PIPER_HOME and no checkout on its path.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CATALOG_FOLDERS = ("models", "platforms", "calibration", "validation")
SOURCE = ("piper_plan", *CATALOG_FOLDERS, "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")

pytestmark = pytest.mark.install


def tracked_catalog_files() -> list[str]:
    """The catalog folders' files git tracks (what a clone holds), as paths relative to the checkout; outside a git
    checkout (a source archive), every file in them but hidden ones, bytecode and calibration jobs' Slurm logs."""
    try:
        done = subprocess.run(["git", "ls-files", *CATALOG_FOLDERS], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        done = None
    if done is not None and done.returncode == 0:
        return done.stdout.split()
    return [str(f.relative_to(ROOT)) for folder in CATALOG_FOLDERS for f in sorted((ROOT / folder).rglob("*"))
            if f.is_file() and not f.name.startswith(".") and f.suffix not in (".pyc", ".out")]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the folder pip installed it into)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    for name in SOURCE:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__", "*.egg-info")}
                                            if (ROOT / name).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp / "dist"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("piper_plan-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)], check=True,
                   timeout=300)
    return wheel, tmp / "site"


def piper(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PIPER_HOME", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, "-m", "piper_plan.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_wheel_holds_every_tracked_catalog_file(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in tracked_catalog_files() if f"piper_plan/_home/{f}" not in names]
    assert not missing, f"not in the wheel: {missing}"


def test_an_installed_wheel_plans_from_another_directory_with_its_calibration(installed, tmp_path):
    _, site = installed
    models = piper(site, tmp_path, "models", "--json")
    assert models.returncode == 0, models.stderr
    assert "deepseek-v3" in {row["name"] for row in json.loads(models.stdout)}
    planned = piper(site, tmp_path, "plan", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8",
                    "--top", "1", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["sources"]["compute"].startswith("calibration: calibration/frontier/gemm.csv"), plan["sources"]
    checked = piper(site, tmp_path, "validate", "--dataset", "korthikanti-a100")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert not list(tmp_path.iterdir()), "piper wrote into the directory it ran in"


def test_an_installed_wheel_keeps_to_its_catalog_and_writes_reports_where_it_runs(installed, tmp_path):
    """Another project's top-level models/ in site-packages is not piper's checkout (the catalog stayed the wheel's
    own); a report's default path is the working directory's docs/, not the installed package."""
    _, site = installed
    (site / "models").mkdir(exist_ok=True)
    try:
        shown = piper(site, tmp_path, "platforms", "--json")
        assert shown.returncode == 0 and "frontier" in shown.stdout, shown.stderr
    finally:
        (site / "models").rmdir()
    halo = piper(site, tmp_path, "reproduce", "halo")
    assert halo.returncode == 0, halo.stderr
    assert (tmp_path / "docs" / "halo.md").is_file() and not (site / "piper_plan" / "_home" / "docs").exists()
