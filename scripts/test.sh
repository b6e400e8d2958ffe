#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install what the tests need, start the local Slurm cluster, run pytest.
# Usage: scripts/test.sh [pytest args...]   (with arguments: one pytest run with them, on one core)
# Without arguments the suite runs in two parts: the fast tier (no Slurm job, no rank process) on every core
# (pytest-xdist), then the tests that start Slurm jobs or rank processes, the fuzz tier, the micro-benchmarks of
# this machine and the wheel's install, one at a time (their ranks use the cores themselves; a benchmark measures
# alone). Every test runs in exactly one part: the fast tier's marker filter leaves out slurm, distributed, fuzz,
# bench and install (tests/conftest.py), the second part's takes exactly those.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
if [[ -x scripts/slurm-local.sh ]] && command -v slurmctld >/dev/null 2>&1; then
  scripts/slurm-local.sh >/tmp/piper-slurm-start.log 2>&1 || { cat /tmp/piper-slurm-start.log; exit 1; }
fi
if [[ $# -gt 0 ]]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
fast=0
.venv/bin/python -m pytest -q -n auto -m "not slurm and not distributed" || fast=$?
rest=0
.venv/bin/python -m pytest -q -m "slurm or distributed or fuzz or bench or install" || rest=$?
echo "fast tier: exit ${fast}; slurm, distributed, fuzz, bench and install tiers: exit ${rest}"
exit $(( fast != 0 ? fast : rest ))
