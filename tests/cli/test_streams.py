"""Output streams through a real shell (docs/design-notes.md, "Output streams"): the result on stdout, diagnostics
on stderr, so that pipes and redirections capture what a user reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PIPER = Path(sys.executable).parent / "piper"

pytestmark = pytest.mark.distributed   # every test starts real shell and piper processes: the multi-process tier


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": f"{PIPER.parent}:/usr/bin:/bin"})


def test_models_piped_into_head_shows_the_table(tmp_path):
    done = shell("piper models | head -4", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "piper model catalog" in done.stdout and "name" in done.stdout
    assert len(done.stdout.splitlines()) == 4 and done.stderr == ""


def test_plan_redirected_to_a_file_captures_the_table_and_saved_is_a_diagnostic(tmp_path):
    done = shell("piper plan --model tiny-moe --platform local-cpu --nodes 1 --seq 256 --global-batch 8 "
                 "--save plan.json > plan.txt", tmp_path)
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "plan.txt").read_text()
    assert "top plans" in table and "candidates" in table and "\x1b[" not in table   # no colour into a file
    assert done.stderr.startswith("saved ") and "saved" not in table
    assert (tmp_path / "plan.json").is_file()


def test_json_replaces_the_human_result(tmp_path):
    import json

    done = shell("piper plan --model tiny-moe --platform local-cpu --nodes 1 --seq 256 --global-batch 8 --json",
                 tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["feasible"] > 0 and "top plans" not in done.stdout


def test_a_reader_that_leaves_early_is_a_quiet_141(tmp_path):
    for extra in ("", " --json"):
        done = shell(f"piper models{extra} | true", tmp_path)      # `true` has left before piper writes
        assert done.returncode == 141 and done.stderr == "", (extra, done.stderr)
