"""``piper export --engine torchtitan|megatron PLAN.json -o job.sh``: the same model and degrees as another
engine's launch. Thin: read the plan, render with ``piper_plan.export``, write the script (or print it)."""

from __future__ import annotations

import os

import click

from piper_plan.cli.common import exit_codes, json_option, note, output_option, print_json
from piper_plan.export import ENGINES


@click.command("export", epilog=exit_codes())
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("--engine", type=click.Choice(ENGINES), required=True,
              help="torchtitan 0.3 (torchrun -m torchtitan.train) or Megatron-LM (pretrain_gpt.py).")
@output_option("out_path", "Write the job script to FILE (executable); default: print it on stdout.")
@json_option(help="The script and the file it was written to as JSON on stdout.")
def export_cmd(plan, engine, out_path, as_json) -> None:
    """Write the launch of another training engine for a plan.json (same model, degrees, batch, precision)."""
    from piper_plan.errors import PiperError
    from piper_plan.export import render
    from piper_plan.fileio import atomic_write_text, check_writable
    from piper_plan.planfile import in_plan_file, read_plan_file

    if out_path:
        check_writable(out_path)
    plan_file = read_plan_file(plan)
    try:                                        # all that can fail, before anything is written
        from piper_plan.launch.job import repriced

        fresh, changed = repriced(plan_file)    # as `piper launch` sizes and checks it
        text = render(fresh, engine)
        warnings = export_warnings(plan_file, fresh, changed)
    except PiperError as exc:                   # what the engine cannot take names the plan file and its field
        raise in_plan_file(exc, plan) from None
    if out_path:
        os.chmod(atomic_write_text(out_path, text), 0o755)
        note(f"wrote {out_path}")
    for warning in warnings:
        note(f"warning: {warning}")
    if as_json:
        print_json({"engine": engine, "plan": plan, "output": out_path, "script": text, "warnings": warnings})
    elif not out_path:
        click.echo(text, nl=False)


def export_warnings(plan_file, fresh, changed: bool) -> list[str]:
    """What a reader of the exported job should know of its plan file: its plan, priced again as `piper launch`
    prices it (``fresh``), does not fit, or the stored prediction is not what the plan costs now (``changed``: a
    hand-edited recipe, batch or platform)."""
    from piper_plan.export.script import fit_warning
    from piper_plan.launch.job import stale_note

    found = [fit_warning(fresh), stale_note(plan_file.prediction, fresh.prediction) if changed else None]
    return [w for w in found if w]
