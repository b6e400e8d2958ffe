"""``piper run``: a thin alias of ``python -m piper_plan.runtime.train`` (same options; torch imported only here)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from piper_plan.cli.common import exit_codes, json_option, out_dir_option, print_json
from piper_plan.errors import EXIT_REQUEUE, EXIT_USER_ERROR


@click.command("run", context_settings={"ignore_unknown_options": True}, epilog=exit_codes({EXIT_REQUEUE: "checkpointed on SIGTERM / SIGUSR1 (the batch script requeues)"}))
@click.option("--plan", "plan", required=True, type=click.Path(dir_okay=False), help="plan.json to run.")
@click.option("--steps", type=int, default=None, help="Optimizer steps (default: the plan's runtime.steps).")
@out_dir_option("out", "Run directory (metrics.jsonl, summary.json, checkpoints/).", old=("--out",), default="run",
                show_default=True)
@click.option("--resume", is_flag=True, help="Continue from RUN_DIR/checkpoints/latest.")
@click.option("--profile", type=int, default=0, metavar="STEPS", help="Chrome trace of STEPS steps after the first.")
@click.option("--lr", type=float, default=None, help="Peak learning rate (default: the plan's runtime.lr).")
@click.option("--aux-loss-coeff", type=float, default=None,
              help="Balance-loss coefficient (default: the plan's runtime.aux_loss_coeff).")
@json_option(help="Rank 0: the run's summary (summary.json, with the run directory and exit code) on stdout.")
def run_cmd(plan, steps, out, resume, profile, lr, aux_loss_coeff, as_json) -> None:
    """Run the training runtime on a plan.json (launch it under torchrun or srun for several ranks)."""
    from piper_plan.runtime.train import main

    argv = ["--plan", plan, "--out", out, "--profile", str(profile)]
    argv += ["--lr", str(lr)] if lr is not None else []
    argv += ["--aux-loss-coeff", str(aux_loss_coeff)] if aux_loss_coeff is not None else []
    argv += (["--steps", str(steps)] if steps else []) + (["--resume"] if resume else [])
    code = main(argv)
    if as_json and os.environ.get("RANK", "0") == "0":
        print_run_summary(Path(out), code)
    sys.exit(code)


def print_run_summary(run_dir: Path, code: int) -> None:
    """summary.json of a finished run as one JSON object on stdout (nothing to print after a user error)."""
    from piper_plan.fileio import parse_json, read_text

    summary = run_dir / "summary.json"
    if code == EXIT_USER_ERROR or not summary.is_file():
        return
    print_json({"run_dir": str(run_dir), **parse_json(read_text(summary), str(summary))})
