"""Suite-wide setting: bytecode caching stays on even where the environment sets PYTHONDONTWRITEBYTECODE.

The suite starts hundreds of `piper` and rank processes; without cached bytecode each recompiles every module it
imports, and pytest re-rewrites every test module's asserts on every run (measured on the fast tier,
`pytest -m "not slurm and not distributed"`: 69.8 s with PYTHONDONTWRITEBYTECODE=1, 53.4 s without)."""

import os
import sys

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
