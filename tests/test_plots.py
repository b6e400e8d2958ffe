"""The optional PNG outputs (extra `plot`: matplotlib), which the test install includes. Each picture is read back:
PNG signature, the size its header states, and pixels that are not one flat colour."""

import json
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli

pytest.importorskip("matplotlib")  # an optional extra; scripts/install.sh --test installs it

TINY = ["--model", "tiny-moe", "--platform", "local-cpu", "--seq", "64", "--global-batch", "8"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the 8-byte PNG signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_picture(path, min_width: int = 400, min_height: int = 300) -> None:
    from matplotlib.image import imread

    width, height = png_size(path)
    assert width >= min_width and height >= min_height
    pixels = imread(path)
    assert pixels.shape[:2] == (height, width)
    gray = pixels[..., :3].mean(axis=2)
    assert gray.std() > 0.05                   # a blank (one-colour) canvas has 0
    assert (gray < 0.9).mean() > 0.01          # more than a frame: at least 1% of the pixels are drawn on


def test_calibrate_show_plot(tmp_path):
    out = tmp_path / "curves.png"
    res = run("calibrate", "show", "--platform", "local-cpu", "--plot", out)
    assert res.exit_code == 0, res.output
    assert_picture(out)


def test_reproduce_halo_plot(tmp_path):
    out = tmp_path / "halo.md"
    res = run("reproduce", "halo", "--out", out)
    assert res.exit_code == 0, res.output
    assert_picture(tmp_path / "halo.png") and "](halo.png)" in out.read_text()


def test_plan_plot_marks_every_evaluated_candidate(tmp_path):
    out = tmp_path / "plan.png"
    res = run("plan", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--plot", out)
    assert res.exit_code == 0, res.output
    assert f"wrote {out}" in res.stderr
    assert_picture(out)


def test_candidate_status_partitions_the_evaluated_plans():
    from piper_plan.catalog import load_model, load_platform
    from piper_plan.search import engine
    from piper_plan.search.report import candidate_status
    from piper_plan.specs import TrainingSpec

    model, platform = load_model("mixtral-8x7b"), load_platform("frontier")
    result = engine.search(model, platform, TrainingSpec(seq_len=4096, global_batch=1024), 8)
    status = candidate_status(result)
    names, counts = np.unique(status, return_counts=True)
    got = dict(zip(names, counts))
    assert got["feasible"] == result.feasible
    assert got["out_of_memory"] == result.reasons["out_of_memory"]
    assert len(status) == len(result.fields["dp"])
    tiny = engine.search(load_model("tiny-moe"), load_platform("local-cpu"), TrainingSpec(seq_len=64, global_batch=8),
                         1, runnable=True)
    names, counts = np.unique(candidate_status(tiny), return_counts=True)
    got = dict(zip(names, counts))
    assert got["feasible"] == tiny.feasible and got.get("not_runnable", 0) == tiny.reasons.get("not_runnable", 0)


def test_plan_plot_when_nothing_fits(tmp_path):
    out = tmp_path / "none.png"
    res = run("plan", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "1", "--memory-headroom", "0.99",
              "--plot", out)        # 0.64 GiB usable: below the framework bytes, so no larger allocation is searched
    assert res.exit_code == 3, res.output
    assert_picture(out)


def test_estimate_plot(tmp_path):
    out = tmp_path / "estimate.png"
    res = run("estimate", "--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--dp", "8",
              "--pp", "8", "--ep", "8", "--plot", out)
    assert res.exit_code == 0, res.output
    assert_picture(out)


def test_compare_plot(tmp_path):
    plan = tmp_path / "plan.json"
    assert run("plan", *TINY, "--nodes", "1", "--runnable", "-o", plan).exit_code == 0
    records = [{"schema_version": 1, "step": s, "step_time_s": 0.05 + 0.01 * (s == 1), "tokens_per_s": 1e4,
                "time_s": {"a2a": 0.01, "p2p": 0.002, "dp_sync": 0.004, "migration": 0.0},
                "memory_bytes": [1e7]} for s in range(1, 9)]      # one entry per stage of the pp 1 plan
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "compare.png"
    res = run("compare", tmp_path, "--plot", out)
    assert res.exit_code == 0, res.output
    assert "a2a time per step" in res.stdout
    assert_picture(out)
    assert json.loads(run("compare", tmp_path, "--json").stdout)["time_s"]["a2a"]["measured"] == 0.01


@pytest.mark.parametrize("name, needle", [("plot.txt", "ending in .png"), ("sub", "is a directory"),
                                          ("afile/x.png", "is a file, not a folder")])
def test_bad_plot_path_is_one_line_and_writes_nothing(tmp_path, name, needle):
    (tmp_path / "sub").mkdir()
    (tmp_path / "afile").write_text("x")
    for args in (["plan", *TINY, "--nodes", "1"], ["estimate", *TINY, "--nodes", "1", "--dp", "2", "--ep", "2"]):
        res = run(*args, "--plot", tmp_path / name)
        assert res.exit_code == 2, res.output
        errors = [line for line in res.stderr.splitlines() if line]
        assert len(errors) == 1 and errors[0].startswith("error:") and needle in errors[0], res.stderr
        assert res.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "sub"]


def test_plot_with_a_node_range_is_refused(tmp_path):
    res = run("plan", *TINY, "--nodes", "1..2", "--plot", tmp_path / "x.png")
    assert res.exit_code == 2 and "--plot needs one node count" in res.stderr
