"""``piper run``: a thin alias of ``python -m piper_plan.runtime.train`` (same options; torch imported only here)."""

from __future__ import annotations

import sys

import click


@click.command("run", context_settings={"ignore_unknown_options": True})
@click.option("--plan", "plan", required=True, type=click.Path(dir_okay=False), help="plan.json to run.")
@click.option("--steps", type=int, default=None, help="Optimizer steps (default: the plan's runtime.steps).")
@click.option("--out", default="run", show_default=True, help="Run directory.")
@click.option("--resume", is_flag=True, help="Continue from RUN_DIR/checkpoints/latest.")
@click.option("--profile", type=int, default=0, metavar="STEPS", help="Chrome trace of STEPS steps after the first.")
@click.option("--lr", type=float, default=1e-3, show_default=True, help="Learning rate.")
@click.option("--aux-loss-coeff", type=float, default=0.01, show_default=True, help="Balance-loss coefficient.")
def run_cmd(plan, steps, out, resume, profile, lr, aux_loss_coeff) -> None:
    """Run the training runtime on a plan.json (launch it under torchrun or srun for several ranks)."""
    from piper_plan.runtime.train import main

    argv = ["--plan", plan, "--out", out, "--profile", str(profile), "--lr", str(lr),
            "--aux-loss-coeff", str(aux_loss_coeff)]
    argv += (["--steps", str(steps)] if steps else []) + (["--resume"] if resume else [])
    sys.exit(main(argv))
