"""``piper validate``: predict every published datapoint in validation/*.yaml and report the error.

Thin: load, call ``piper_plan.validation``, render (rich tables on stderr; --json on stdout). Exit 1 when a
gated row or a dataset's mean error exceeds its tolerance (so CI fails when the model drifts); 2 for user errors.
"""

from __future__ import annotations

import sys

import click

from piper_plan.cli.common import console, print_json

EXIT_VIOLATION = 1


@click.command("validate")
@click.option("--dataset", "datasets", multiple=True, help="Dataset name or path (repeatable; default: all of validation/).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
def validate_cmd(datasets, as_json) -> None:
    """Predict published measurements and report the error."""
    from piper_plan.validation import all_violations, validate

    results = validate(list(datasets) or None)
    violations = all_violations(results)
    if as_json:
        print_json({"datasets": [r.to_dict() for r in results], "violations": violations, "ok": not violations})
    else:
        for r in results:
            render_dataset(r)
        render_violations(violations)
    if violations:
        sys.exit(EXIT_VIOLATION)


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}%"


def dataset_table(r):
    from rich.table import Table

    s = r.spec
    fit = " [USED FOR FITTING]" if s.used_for_fitting else " [held out]"
    table = Table(title=f"{s.name}{fit}: {s.description}", title_justify="left")
    for col in ("row", "quantity", "published", "predicted", "error", "tolerance", "split", "ok"):
        table.add_column(col, justify="left" if col in ("row", "quantity", "split") else "right")
    for row in r.rows:
        err = "-" if row.rel_error is None else f"{100 * row.rel_error:+.2f}%"
        ok = "yes" if row.ok else "NO"
        ok = ok if row.gated else "(not gated)"
        table.add_row(row.id, row.quantity, _num(row.published), _num(row.predicted), err,
                      f"{row.tolerance_pct:g}%", row.split, ok)
    return table


def render_dataset(r) -> None:
    out = console()
    out.print(dataset_table(r))
    s = r.spec
    goal = f", goal {s.goal_mean_pct:g}%" if s.goal_mean_pct is not None else ""
    out.print(f"{s.name}: mean |error| {_pct(r.mean_abs_pct_error)} (tolerance {s.tolerance_pct.mean:g}%{goal}), "
              f"max {_pct(r.max_abs_pct_error)}, held-out mean {_pct(r.held_out_mean_abs_pct_error)}", markup=False)
    out.print(f"  source: {s.citation}", markup=False)
    if s.fitted:
        out.print(f"  fitted: {s.fitted}", markup=False)


def render_violations(violations: list[str]) -> None:
    out = console()
    if not violations:
        out.print("every gated row and mean within tolerance", markup=False)
        return
    out.print(f"{len(violations)} tolerance violation(s):", markup=False)
    for v in violations:
        out.print(f"  {v}", markup=False)
