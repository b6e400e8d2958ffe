"""Output whole at any terminal width: a COLUMNS too small to believe is read as unset (COLUMNS=0 printed nothing),
and a table wider than the terminal prints as plain text rather than with its cells cut ('de…', '926,679,0…')."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from piper_plan.cli import common
from piper_plan.cli.main import cli

TINY_PLAN = ["--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq", "64", "--global-batch", "8",
             "--runnable"]


@pytest.fixture
def at_columns(monkeypatch):
    """``at_columns(value)``: run the CLI in-process as under COLUMNS=value (None: unset). The consoles read the
    environment once per process, so each width starts them afresh."""
    def run(value, *args):
        if value is None:
            monkeypatch.delenv("COLUMNS", raising=False)
        else:
            monkeypatch.setenv("COLUMNS", str(value))
        common._console.cache_clear()
        return CliRunner().invoke(cli, [str(a) for a in args])

    yield run
    common._console.cache_clear()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory: a tiny plan.json and three steps of metrics.jsonl (what `compare` and `estimate --plan`
    read)."""
    folder = tmp_path_factory.mktemp("run")
    done = CliRunner().invoke(cli, ["plan", *TINY_PLAN, "-o", str(folder / "plan.json")])
    assert done.exit_code == 0, done.output
    plan = json.loads((folder / "plan.json").read_text())
    step = plan["prediction"]["step_time_s"]
    records = [{"schema_version": 1, "step": s, "loss": 6.0, "step_time_s": step, "tokens": 512,
                "tokens_per_s": 512 / step, "time_s": {}, "parallel": plan["parallel"],
                "memory_bytes": [{"stage": 0, "total_bytes": 1, "source": "tensor accounting"}]} for s in (1, 2, 3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def commands(run_dir):
    return {"models": ["models"], "model show": ["model", "show", "deepseek-v3"], "platforms": ["platforms"],
            "estimate": ["estimate", "--plan", run_dir / "plan.json"], "compare": ["compare", run_dir],
            "migrate": ["migrate", "simulate", "--experts", "64", "--ep", "8", "--skew", "zipf:1.2"],
            "validate": ["validate", "--dataset", "korthikanti-a100"],
            "nothing fits": ["plan", "--model", "mixtral-8x7b", "--platform", "local-cpu", "--nodes", "1"]}


@pytest.mark.parametrize("name", ["models", "model show", "platforms", "estimate", "compare", "migrate", "validate",
                                  "nothing fits"])
def test_a_columns_below_the_minimum_is_read_as_unset(at_columns, run_dir, name):
    """COLUMNS=0 printed nothing (exit 0; plan lost its closest candidates), COLUMNS=1 one character a line."""
    args = commands(run_dir)[name]
    unset = at_columns(None, *args)
    assert unset.stdout.strip() and unset.exit_code in (0, 1, common.EXIT_NOTHING_FITS), unset.output
    for columns in (0, 1, common.MIN_COLUMNS - 1, "²"):
        done = at_columns(columns, *args)
        assert (done.exit_code, done.stdout) == (unset.exit_code, unset.stdout), (columns, done.output)


def test_a_diagnostic_survives_a_zero_width(at_columns, run_dir, tmp_path):
    out = tmp_path / "e.json"
    done = at_columns(0, "estimate", "--plan", run_dir / "plan.json", "-o", out)
    assert done.exit_code == 0 and f"wrote {out}" in done.stderr, done.output


def whole_values(name: str, run_dir) -> list[str]:
    """What a reader must find whole in ``name``'s table: row names, ids and numbers, from its --json."""
    from piper_plan.cli.estimate import _gib
    from piper_plan.cli.models import format_count

    got = json.loads(CliRunner().invoke(cli, [str(a) for a in commands(run_dir)[name]] + ["--json"]).stdout)
    if name == "models":
        return [v for r in got for v in (r["name"], format_count(r["total_params"]), format_count(r["active_params"]))]
    if name == "model show":
        return [*got["params_by_component"], *(f"{n:,}" for n in got["params_by_component"].values())]
    if name == "platforms":
        return [v for r in got for v in (r["name"], r["device"])]
    if name == "validate":
        return [v for r in got["datasets"][0]["rows"] for v in (r["id"], r["quantity"], r["split"])]
    if name == "estimate":
        return [_gib(s["total_bytes"]) for s in got["memory"]["per_stage"]] + [
            term for term, seconds in got["time"]["breakdown"].items() if seconds > 0]
    raise ValueError(name)


@pytest.mark.parametrize("columns", [40, 80])
@pytest.mark.parametrize("name", ["models", "model show", "platforms", "validate", "estimate"])
def test_every_table_cell_is_whole_in_a_narrow_terminal(at_columns, run_dir, name, columns):
    """At 80 columns validate showed '22b-ful…' and 'step_ti…' (which row failed?), platforms cut device names; at
    40 models showed 'de…' for deepseek-v2 and v3 alike, and model show cut its exact counts to '926,679,0…'."""
    done = at_columns(columns, *commands(run_dir)[name])
    assert done.exit_code in (0, 1), done.output
    assert "…" not in done.stdout, done.stdout
    words = done.stdout.replace("\n", "  ")
    missing = [v for v in whole_values(name, run_dir) if f" {v} " not in f" {words} "]
    assert not missing, (missing, done.stdout)


def test_a_table_that_fits_is_still_drawn_by_rich(at_columns):
    done = at_columns(200, "models")
    assert done.exit_code == 0 and "┃ name" in done.stdout, done.stdout


def test_a_plain_table_shows_its_cells_as_rich_does():
    """A cell's markup applies in plain text too: an escaped '[' (a model named 'a[b]') is a '[', no backslash."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="t")
    table.add_column("name")
    table.add_row(escape("a[b]"))
    assert common.plain_table_text(table).splitlines() == ["t", "name", "────", "a[b]"]


def test_a_dataset_title_keeps_its_brackets(at_columns):
    """rich read ' [held out]' in validate's table title as a style and dropped it: 'korthikanti-a100 : Dense GPT'."""
    for columns in (40, 200):                               # plain text and rich's table alike
        done = at_columns(columns, "validate", "--dataset", "korthikanti-a100")
        assert "korthikanti-a100 [held out]: Dense GPT" in done.stdout, done.stdout
