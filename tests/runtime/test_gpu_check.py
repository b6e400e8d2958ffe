"""benchmarks/gpu_check.py's CPU mode end to end (in this process, world 1): every section is written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench      # it calibrates this machine and times training steps

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_run_writes_every_section(tmp_path, world1):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu-check.md"
    assert gpu_check.main(["--device", "cpu", "--steps", "3", "--profile", "--out", str(out)]) == 0
    text = out.read_text()
    assert "This is the CPU run: no GPU was available" in text
    for heading in ("## 1. Calibration", "## 2. Mixtral-style", "## 3. DeepSeek-V3-style"):
        assert heading in text
    assert text.count("| step time (s) |") == 2 and text.count("Grouped expert GEMMs") == 2
    assert "torch._grouped_mm, gate/up/down" in text          # the runtime ran grouped GEMMs, not the loop
    assert text.count("Predicted step by component (ms): ") == 2
    assert text.count("Where 2 more steps spent their CPU time (torch.profiler") == 2 and "aten::mm" in text
    assert "skipped" not in text and text.rstrip().endswith("s.")
