"""DESIGN.md layering: the planner never imports torch, rich or click; the CLI loads commands lazily."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "rich", "click")


def modules_loaded_by(statement: str) -> set[str]:
    code = f"{statement}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


PLANNER_MODULES = ["piper_plan.specs", "piper_plan.specs.vocab", "piper_plan.specs.estimate", "piper_plan.catalog",
                   "piper_plan.plans", "piper_plan.capability", "piper_plan.planfile", "piper_plan.cost.evaluate",
                   "piper_plan.cost.batch", "piper_plan.cost.overhead", "piper_plan.search.engine",
                   "piper_plan.search.report", "piper_plan.search.space", "piper_plan.placement.migration",
                   "piper_plan.launch.job", "piper_plan.launchenv", "piper_plan.validation", "piper_plan.plots",
                   "piper_plan.export.torchtitan", "piper_plan.export.megatron"]


def test_planner_imports_no_torch_rich_click():
    """The modules that do the planner's work, all imported in one fresh interpreter: none pulls torch, rich or
    click in (one of them doing so would show here)."""
    loaded = modules_loaded_by("\n".join(f"import {m}" for m in PLANNER_MODULES))
    assert set(PLANNER_MODULES) <= loaded
    assert not {m for m in loaded if m.split(".")[0] in HEAVY + ("matplotlib",)}


def test_cli_help_imports_no_torch_and_no_command_module():
    loaded = modules_loaded_by("from piper_plan.cli.main import cli\n"
                               "try:\n    cli(['--help'])\nexcept SystemExit:\n    pass")
    assert "torch" not in loaded and "matplotlib" not in loaded
    assert not {m for m in loaded if m.startswith("piper_plan.cli.") and m not in
                ("piper_plan.cli.main",)}


def _imports(path: Path) -> set[str]:
    """piper_plan modules ``path`` imports, at module level or inside functions (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("piper_plan"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("piper_plan"))
    return out


def _module_graph() -> dict[str, set[str]]:
    root = Path(__file__).resolve().parents[1]
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (root / "piper_plan").rglob("*.py")}
    return {m: {d for d in _imports(p) if d in files and d != m} for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if not state.get(nxt) and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if not state.get(start) and (found := visit(start, [start])):
            return found
    return None


def test_module_import_graph_has_no_cycles():
    """Every import counts, lazy ones inside functions too: no module depends on itself through others."""
    graph = _module_graph()
    assert len(graph) > 80
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
