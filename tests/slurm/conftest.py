"""The local multi-node Slurm cluster (scripts/slurm-local.sh), started once per test session.

Tests marked ``slurm`` use the ``slurm_cluster`` fixture. Under CI=true a missing Slurm is a failure, never a skip;
elsewhere the tests skip when Slurm is not installed or we are not root (the script starts daemons as root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "launch"))  # launch_plans: the plan-file helper shared with tests/launch

START_TIMEOUT_S = 240


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def slurm_cluster() -> dict:
    """Start (idempotently) the local cluster; returns the environment to talk to it (SLURM_CONF)."""
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(t) is None]
    problem = f"Slurm tools missing: {missing}" if missing else ("needs root" if os.geteuid() != 0 else None)
    if problem and not _in_ci():
        pytest.skip(f"local Slurm unavailable ({problem}); run scripts/slurm-local.sh (CI=true never skips)")
    proc = subprocess.run([str(ROOT / "scripts" / "slurm-local.sh")], capture_output=True, text=True,
                          timeout=START_TIMEOUT_S)
    assert proc.returncode == 0, f"slurm-local.sh failed:\n{proc.stdout}\n{proc.stderr}"
    conf = os.environ.get("PIPER_SLURM_DIR", "/tmp/piper-slurm") + "/etc/slurm.conf"
    os.environ["SLURM_CONF"] = conf
    return {"SLURM_CONF": conf}
