"""``piper models``, ``piper model show NAME|FILE``, ``piper model import CONFIG.json``.

Parameter counts print in decimal (46.7B, DESIGN.md conventions); ``--json`` prints exact integers on stdout.
"""

from __future__ import annotations

from pathlib import Path

import click

from piper_plan.cli.common import console, exit_codes, json_option, note, output_option, print_json, print_table

_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))


def format_count(n: int) -> str:
    """A parameter count in decimal units: 46.7B, 1.03T, 903.7K (never a 1024 divisor)."""
    for scale, unit in _UNITS:
        if n >= scale:
            value = n / scale
            return f"{value:.2f}{unit}" if value < 10 else f"{value:.1f}{unit}"
    return str(n)


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 9] -> '0-2, 5, 7, 9' (runs of consecutive indices; '-' when empty)."""
    if not layers:
        return "-"
    runs, start, prev = [], layers[0], layers[0]
    for i in layers[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(f"{start}-{prev}" if prev > start else str(start))
        if i is not None:
            start = prev = i
    return ", ".join(runs)


def model_row(spec) -> dict:
    """The catalog-listing object of one model (exact integers)."""
    moe = spec.moe
    return {"name": spec.name, "total_params": spec.total_params, "active_params": spec.active_params,
            "num_layers": spec.num_layers, "num_moe_layers": spec.num_moe_layers,
            "num_experts": moe.num_experts if moe else 0, "top_k": moe.top_k if moe else 0,
            "num_shared_experts": moe.num_shared_experts if moe else 0}


def model_summary(spec) -> dict:
    """Everything ``piper model show`` reports, as one JSON-ready object."""
    p = spec.params
    moe_layers = list(spec.moe_layers)
    return {**model_row(spec),
            "active_params_excluding_embedding": p.active_excluding_embedding,
            "non_embedding_params": p.non_embedding,
            "params_by_component": {k: v for k, v in p.as_dict().items()
                                    if k not in ("total", "active", "active_excluding_embedding", "mtp", "mtp_active",
                                                 "total_with_mtp")},
            "mtp_layers": spec.mtp_layers,
            "mtp_params": p.mtp, "mtp_active_params": p.mtp_active, "total_params_with_mtp": p.total_with_mtp,
            "moe_layers": moe_layers,
            "dense_layers": [i for i in range(spec.num_layers) if i not in set(moe_layers)],
            "source": spec.source, "notes": spec.notes, "spec": spec.model_dump(mode="json")}


def render_models_table(rows: list[dict]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="piper model catalog (counts in decimal units)")
    for col in ("name", "total", "active", "layers", "MoE layers", "experts", "top-k"):
        table.add_column(col, justify="left" if col == "name" else "right")
    for r in rows:
        table.add_row(escape(r["name"]), format_count(r["total_params"]), format_count(r["active_params"]),
                      str(r["num_layers"]), str(r["num_moe_layers"]),
                      _experts_text(r), str(r["top_k"] or "-"))
    print_table(table)


def _experts_text(row: dict) -> str:
    if not row["num_experts"]:
        return "-"
    shared = f" + {row['num_shared_experts']}" if row["num_shared_experts"] else ""
    return f"{row['num_experts']}{shared}"


def render_model_summary(s: dict) -> None:
    from rich.table import Table

    out = console()
    out.print(f"{s['name']}: {format_count(s['total_params'])} total, {format_count(s['active_params'])} active "
              f"({format_count(s['active_params_excluding_embedding'])} without the input embedding)", markup=False)
    table = Table(show_header=True)
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("exact", justify="right")
    for name, n in s["params_by_component"].items():
        table.add_row(name, format_count(n), f"{n:,}")
    for label, key in (("total", "total_params"), ("active", "active_params"),
                       ("active without input embedding", "active_params_excluding_embedding"),
                       ("non-embedding", "non_embedding_params")):
        table.add_row(label, format_count(s[key]), f"{s[key]:,}")
    if s["mtp_layers"]:
        for label, key in ((f"MTP modules ({s['mtp_layers']}, not in total)", "mtp_params"),
                           ("MTP active", "mtp_active_params"), ("total with MTP", "total_params_with_mtp")):
            table.add_row(label, format_count(s[key]), f"{s[key]:,}")
    print_table(table)
    out.print(f"layers: {s['num_layers']}; MoE: {layer_ranges(s['moe_layers'])}; "
              f"dense: {layer_ranges(s['dense_layers'])}", markup=False)
    out.print(f"source: {s['source']}", markup=False)
    if s["notes"]:
        out.print(f"notes: {s['notes']}", markup=False)


@click.command("models", epilog=exit_codes())
@json_option(help="Print a JSON list on stdout.")
def models_cmd(as_json: bool) -> None:
    """List the model catalog (models/*.yaml)."""
    from piper_plan.catalog import list_models

    rows = [model_row(m) for m in list_models()]
    if as_json:
        print_json(rows)
    else:
        render_models_table(rows)


def _name_option(name: str | None) -> str | None:
    """``--name`` as given, or one error line naming --name: a name the spec refuses (the spec's check blamed the
    config file), or one holding bytes this locale cannot decode (LC_ALL=C with PYTHONUTF8=0 reads a UTF-8 'é' as
    two lone surrogates, which the spec's JSON check called the config file's invalid JSON)."""
    import sys

    from piper_plan.errors import PiperError
    from piper_plan.specs.base import plain_name

    if name is None:
        return None
    if any("\ud800" <= c <= "\udfff" for c in name):
        raise PiperError(f"{ascii(name)} is not text in this locale's encoding ({sys.getfilesystemencoding()}): "
                         "give the name in ASCII, or run piper under a UTF-8 locale (LC_ALL=C.UTF-8) or with "
                         "PYTHONUTF8=1", field="--name")
    try:
        return plain_name(name)
    except ValueError as exc:
        raise PiperError(f"{exc} (got {ascii(name)})", field="--name") from None


@click.group("model")
def model_group() -> None:
    """Show or import one model spec."""


@model_group.command("show", epilog=exit_codes())
@click.argument("model")
@json_option(help="Print one JSON object on stdout.")
def show_cmd(model: str, as_json: bool) -> None:
    """Parameters by component, total / active, and which layers are MoE (MODEL: catalog name or YAML file)."""
    from piper_plan.catalog import load_model

    summary = model_summary(load_model(model))
    if as_json:
        print_json(summary)
    else:
        render_model_summary(summary)


@model_group.command("import", epilog=exit_codes())
@click.argument("config", type=click.Path(path_type=Path))
@output_option("output", "Write the spec here (JSON for a .json file, else YAML); default: YAML on stdout.")
@click.option("--name", help="Catalog name of the spec (default: from the config's _name_or_path or file name).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@json_option(help="Print one JSON object (name, counts, spec) on stdout.")
def import_cmd(config: Path, output: str | None, name: str | None, force: bool, as_json: bool) -> None:
    """Convert a Hugging Face config.json into a piper model spec."""
    from piper_plan.catalog import spec_text
    from piper_plan.errors import PiperError
    from piper_plan.fileio import atomic_write_text, check_writable
    from piper_plan.hf_import import import_hf_file

    spec = import_hf_file(config, _name_option(name))
    output = Path(output) if output is not None else None
    text = spec_text(spec, output)
    if output is not None:
        check_writable(output)                   # a folder or a device is named as such, not as "exists"
        if output.exists() and not force:
            raise PiperError("output file exists; pass --force to overwrite", path=str(output))
        atomic_write_text(output, text)
    if as_json:
        print_json({**model_row(spec), "output": str(output) if output else None, "spec": spec.model_dump(mode="json")})
    elif output is None:
        click.echo(text, nl=False)
    note(f"{spec.name}: {format_count(spec.total_params)} total, {format_count(spec.active_params)} active"
         + (f"; wrote {output}" if output else ""))
