"""DESIGN.md layering: the planner never imports torch, rich or click; the CLI loads commands lazily."""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "rich", "click")


def modules_loaded_by(statement: str) -> set[str]:
    code = f"{statement}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", ["piper_plan.specs", "piper_plan.catalog", "piper_plan.cost",
                                    "piper_plan.search", "piper_plan.placement.migration"])
def test_planner_imports_no_torch_rich_click(module):
    loaded = modules_loaded_by(f"import {module}")
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_cli_help_imports_no_torch_and_no_command_module():
    loaded = modules_loaded_by("from piper_plan.cli.main import cli\n"
                               "try:\n    cli(['--help'])\nexcept SystemExit:\n    pass")
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith("piper_plan.cli.") and m not in
                ("piper_plan.cli.main",)}
