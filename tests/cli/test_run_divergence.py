"""`piper run` of a run whose loss goes nan / inf: every rank stops at the same step, rank 0 says so in one line,
the run exits with EXIT_CHECK_FAILED (runtime/train.py ``divergence``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.cli.common import EXIT_CHECK_FAILED
from piper_plan.cli.main import cli
from piper_plan.runtime.train import EXIT_DIVERGED, divergence, non_finite_loss

PIPER = Path(sys.executable).parent / "piper"
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
SMALL = ["--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq", "64", "--global-batch", "4"]


def saved_plan(tmp_path: Path, **runtime) -> Path:
    """A two-stage plan of tiny-moe (the loss on rank 1) with ``runtime`` settings."""
    path = tmp_path / "plan.json"
    done = CliRunner().invoke(cli, ["estimate", *SMALL, "--pp", "2", "--dp", "1", "--save", str(path)])
    assert done.exit_code == 0, done.output
    plan = json.loads(path.read_text())
    path.write_text(json.dumps({**plan, "runtime": {**plan["runtime"], **runtime}}))
    return path


def report(stage: int, loss: float | None, mtp_loss: float | None = None) -> dict:
    return {"stage": stage, "loss": loss, "mtp_loss": mtp_loss}


def test_a_nan_loss_reads_as_none_and_is_found_on_the_last_stage_only():
    assert non_finite_loss([report(0, None), report(1, 2.5)], last_stage=1) is None
    name, value = non_finite_loss([report(0, None), report(1, None)], last_stage=1)   # nan decodes as None
    assert name == "loss" and math.isnan(value)
    assert non_finite_loss([report(0, 1.0), report(0, math.inf)], last_stage=0) == ("loss", math.inf)
    assert non_finite_loss([report(0, 1.0, -math.inf)], 0, ("loss", "mtp_loss")) == ("mtp_loss", -math.inf)
    assert non_finite_loss([report(0, 1.0, None)], 0) is None                        # no MTP modules
    assert EXIT_DIVERGED == EXIT_CHECK_FAILED


def test_the_divergence_line_names_step_loss_and_settings(tmp_path):
    from piper_plan.planfile import read_plan_file

    cfg = read_plan_file(saved_plan(tmp_path))
    line = divergence([report(0, None), report(1, None)], 3, cfg)
    assert line.startswith("step 3: the loss is nan (runtime.lr 0.001, runtime.weight_decay 0.1, "
                           "runtime.aux_loss_coeff 0.01): the run diverged"), line
    assert divergence([report(0, None), report(1, 4.0)], 3, cfg) is None


@pytest.mark.distributed
def test_a_diverged_run_stops_every_rank_with_one_line(tmp_path):
    """lr 1e4 with weight decay 1e4 (both in range) scales the matrices by 1 - 1e8 a step: nan by step 4. Before
    the check rank 0 died in merge_reports (StopIteration) and rank 1 on a closed connection."""
    plan = saved_plan(tmp_path, lr=1e4, weight_decay=1e4, warmup_steps=0)
    done = subprocess.run([str(PIPER), "run", "--plan", str(plan), "--steps", "6", "--out-dir", "R", "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=CLEAN_ENV)
    assert done.returncode == EXIT_CHECK_FAILED, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the loss is nan (runtime.lr 10000, runtime.weight_decay 10000" in errors[0], \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "StopIteration" not in done.stderr
    summary = json.loads(done.stdout)                              # --json: the summary of the steps before
    assert summary["exit_code"] == EXIT_CHECK_FAILED and summary["steps"] == int(errors[0].split()[2][:-1]) - 1
    rows = (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == summary["steps"] and all(math.isfinite(json.loads(r)["loss"]) for r in rows)
