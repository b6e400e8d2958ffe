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
@click.option("--lr", type=float, default=None, help="Peak learning rate (default: the plan's runtime.lr).")
@click.option("--aux-loss-coeff", type=float, default=None,
              help="Balance-loss coefficient (default: the plan's runtime.aux_loss_coeff).")
def run_cmd(plan, steps, out, resume, profile, lr, aux_loss_coeff) -> None:
    """Run the training runtime on a plan.json (launch it under torchrun or srun for several ranks)."""
    from piper_plan.runtime.train import main

    argv = ["--plan", plan, "--out", out, "--profile", str(profile)]
    argv += ["--lr", str(lr)] if lr is not None else []
    argv += ["--aux-loss-coeff", str(aux_loss_coeff)] if aux_loss_coeff is not None else []
    argv += (["--steps", str(steps)] if steps else []) + (["--resume"] if resume else [])
    sys.exit(main(argv))
