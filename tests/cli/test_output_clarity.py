"""Output that says what it means (issue 20): no footnote for a mark not shown, no Python reprs, a warning when a
saved plan does not fit, and a note when a node range is cut at the platform's size."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from piper_plan.cli.main import cli

PLATFORMS = Path(__file__).resolve().parents[2] / "platforms"
TINY = ["--model", "tiny-moe", "--platform", "local-cpu", "--seq", "256", "--global-batch", "8"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_plan_footnote_only_when_a_balanced_row_is_shown():
    even = run("plan", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--top", "5")
    assert even.exit_code == 0, even.output
    assert " bal " not in even.stdout and "FLOP-balanced" not in even.stdout
    balanced = run("plan", "--model", "deepseek-v3", "--platform", "frontier", "--nodes", "64", "--top", "3")
    assert balanced.exit_code == 0, balanced.output
    assert "1f1b bal" in balanced.stdout and "FLOP-balanced" in balanced.stdout


def test_estimate_scopes_read_as_words():
    done = run("estimate", *TINY, "--nodes", "1", "--dp", "2", "--ep", "2")
    assert done.exit_code == 0, done.output
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("scopes: "))
    assert "{" not in line and "'" not in line and "dp node" in line


def test_estimate_output_of_a_plan_that_does_not_fit_warns_on_stderr(tmp_path):
    args = ["estimate", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--dp", "16", "--pp",
            "4", "--ep", "8"]
    for extra in ([], ["--json"]):
        path = tmp_path / f"plan{len(extra)}.json"
        done = run(*args, "-o", path, *extra)
        assert done.exit_code == 0 and path.is_file(), done.output
        lines = done.stderr.splitlines()
        assert lines[0] == f"wrote {path}" and lines[1].startswith("warning: the saved plan does not fit: peak 66.56")
        if extra:
            assert json.loads(done.stdout)["fits"] is False
    fits = run("estimate", *TINY, "--nodes", "1", "--dp", "2", "--ep", "2", "-o", tmp_path / "ok.json")
    assert fits.exit_code == 0 and "warning" not in fits.stderr, fits.output


def test_a_node_range_past_the_platform_says_where_it_ends():
    done = run("plan", *TINY, "--nodes", "1..1000000000", "--json")
    assert done.exit_code == 0, done.output
    assert done.stderr == "--nodes 1..1000000000: local-cpu has at most 4 nodes; the range ends at 4\n"
    assert [row["nodes"] for row in json.loads(done.stdout)["sweep"]] == [1, 2, 4]
    inside = run("plan", *TINY, "--nodes", "1..4", "--json")
    assert inside.exit_code == 0 and inside.stderr == ""


def test_a_long_path_in_a_diagnostic_stays_one_line_whatever_the_width(tmp_path, monkeypatch):
    """A narrow COLUMNS (a terminal's, or pytest-xdist's workers') must not wrap "wrote PATH" in the middle of the
    path: scripts read it, people copy it."""
    from piper_plan.cli import common

    monkeypatch.setenv("COLUMNS", "40")
    common._console.cache_clear()
    try:
        out = tmp_path.joinpath(*["a-rather-long-directory-name"] * 4, "plan.json")
        done = run("plan", *TINY, "--nodes", "1", "--top", "1", "-o", out)
    finally:
        common._console.cache_clear()
    assert done.exit_code == 0, done.output
    assert f"saved {out} " in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_a_long_plan_table_prints_as_plain_text_with_the_same_rows_as_rich():
    """Over PLAIN_TABLE_ROWS rows the table is plain aligned text (rich took 9 s for 4,500 rows); each row and the
    header hold the same fields, right-aligned numbers stay right-aligned, and the caption follows."""
    import io

    from rich.console import Console

    from piper_plan.cli import common

    whole = run("plan", "--model", "deepseek-v3", "--platform", "frontier", "--nodes", "64", "--top", "0", "--json")
    assert whole.exit_code == 0, whole.output
    shown = min(len(json.loads(whole.stdout)["plans"]), 400)
    assert shown > common.PLAIN_TABLE_ROWS
    plain = run("plan", "--model", "deepseek-v3", "--platform", "frontier", "--nodes", "64", "--top", shown)
    assert plain.exit_code == 0, plain.output
    lines = plain.stdout.splitlines()
    assert lines[0] == "top plans: 64 nodes, 512 devices"
    assert lines[1].split()[:6] == ["#", "dp", "tp", "pp", "ep", "etp"]
    rows = lines[3:3 + shown]
    assert [r.split()[0].rstrip("*") for r in rows] == [str(i) for i in range(1, shown + 1)]
    assert lines[3 + shown].startswith("MFU, HFU: PaLM's FLOP count")
    assert len({len(r) for r in rows}) == 1                       # aligned: the last column is right-justified

    from rich.table import Table

    table = Table(title="t")
    table.add_column("name", justify="left")
    table.add_column("n", justify="right")
    for name, n in (("a", "1"), ("bbb", "1,234")):
        table.add_row(name, n)
    text = common.plain_table_text(table)
    assert text.splitlines() == ["t", "name      n", "────  ─────", "a         1", "bbb   1,234"]
    recorded = Console(width=80, record=True, file=io.StringIO())
    recorded.print(table)
    rich_rows = [ln.strip("│ ").split() for ln in recorded.export_text().splitlines() if "1" in ln]
    assert [ln.split() for ln in text.splitlines()[3:]] == [[c for c in r if c != "│"] for r in rich_rows]


def test_each_degree_sits_under_its_own_label():
    """The degrees were one column "dp tp pp ep etp" of right-aligned "32 1 2 8 1": dp's value sat under "pp"."""
    done = run("plan", "--model", "deepseek-v3", "--platform", "h200", "--nodes", "16", "--cp", "2", "--top", "3",
               "--json")
    best = json.loads(done.stdout)["plans"][0]
    shown = run("plan", "--model", "deepseek-v3", "--platform", "h200", "--nodes", "16", "--cp", "2", "--top", "3")
    header, first = (ln for ln in shown.stdout.splitlines() if ln.strip().startswith(("#", "1 ", "1*")))
    for label in ("dp", "cp", "tp", "pp", "ep", "etp"):
        end = header.index(f" {label} ") + 1 + len(label)            # right-aligned: the value ends where its label does
        assert first[:end].split()[-1] == str(best[label]), (label, header, first)


def test_the_human_provenance_line_points_at_the_citation_instead_of_quoting_it(tmp_path):
    """The compute line quoted the platform's whole efficiency citation (1,767 characters on gb200-nvl72) under
    every table; --json keeps it whole."""
    from piper_plan.catalog import load_platform

    args = ["plan", "--model", "deepseek-v3", "--platform", "gb200-nvl72", "--nodes", "18", "--top", "1"]
    line = next(ln for ln in run(*args).stdout.splitlines() if ln.startswith("compute: "))
    assert "cited: `piper platform show gb200-nvl72`" in line and len(line) < 300, line
    cited = load_platform("gb200-nvl72").efficiency.source
    assert cited in json.loads(run(*args, "--json").stdout)["sources"]["compute"]
    saved = tmp_path / "gb.json"
    assert run(*args, "-o", saved).exit_code == 0
    again = " ".join(run("estimate", "--plan", saved).stdout.split())    # a terminal's width may wrap the line
    assert f"cited: the plan file's platform.efficiency.source ({saved})" in again, again
    as_file = " ".join(run("plan", "--model", "deepseek-v3", "--platform", PLATFORMS / "gb200-nvl72.yaml", "--nodes",
                           "18", "--top", "1").stdout.split())
    assert f"cited: `piper platform show {PLATFORMS / 'gb200-nvl72.yaml'}`" in as_file
