#!/usr/bin/env bash
# Install piper into ./.venv (created if missing). Usage: scripts/install.sh [--test]
#   --test  also installs what the test suite needs: pytest/hypothesis, torch (CPU build where no GPU is present),
#           matplotlib (extra plot), torchtitan 0.3.0 + triton (extra export: the check of `piper export`), and
#           Debian's Slurm packages (for the real local multi-node Slurm tests; needs root + apt-get).
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0; [[ "${1:-}" == "--test" ]] && want_test=1

[[ -x .venv/bin/python ]] || python3 -m venv .venv
py=.venv/bin/python
pip() { "$py" -m pip install --disable-pip-version-check -q "$@"; }

if [[ $want_test == 1 ]]; then
  # torch: keep whatever torch >= 2.6 is already installed (a GPU machine's ROCm/CUDA build); otherwise install the
  # pinned release, which on these machines resolves to the local CPU wheel (see shared/reference/environment.md).
  if ! "$py" -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 6))" 2>/dev/null; then
    pip "torch==${PIPER_TORCH_VERSION:-2.13.0}"
  fi
  pip -e ".[test,runtime,plot,export]"
  # torchtitan's model registries import triton (torchtitan/distributed/minimal_async_ep/kernels.py); GPU torch builds
  # bring it (ROCm: pytorch-triton-rocm, which must not be shadowed), the CPU wheel does not
  "$py" -c "import triton" 2>/dev/null || pip triton
  if ! command -v slurmctld >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge) >/dev/null
  fi
else
  pip -e .
fi
