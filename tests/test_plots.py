"""The optional PNG outputs (extra `plot`: matplotlib), which the test install includes."""

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli

pytest.importorskip("matplotlib")  # an optional extra; scripts/install.sh --test installs it


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_show_plot(tmp_path):
    out = tmp_path / "curves.png"
    res = CliRunner().invoke(cli, ["calibrate", "show", "--platform", "local-cpu", "--plot", str(out)])
    assert res.exit_code == 0, res.output
    assert _is_png(out)


def test_reproduce_halo_plot(tmp_path):
    out = tmp_path / "halo.md"
    res = CliRunner().invoke(cli, ["reproduce", "halo", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert _is_png(tmp_path / "halo.png") and "](halo.png)" in out.read_text()
