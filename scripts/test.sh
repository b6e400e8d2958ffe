#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install what the tests need, start the local Slurm cluster, run pytest.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
if [[ -x scripts/slurm-local.sh ]] && command -v slurmctld >/dev/null 2>&1; then
  scripts/slurm-local.sh >/tmp/piper-slurm-start.log 2>&1 || { cat /tmp/piper-slurm-start.log; exit 1; }
fi
exec .venv/bin/python -m pytest -q "$@"
