"""Optional (needs transformers): every fixture's imported count equals transformers' count on the meta device.

Skips where transformers is absent (it is a dev tool, not a piper dependency). Uses scripts/check_hf_counts.py.
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = sorted((ROOT / "tests/specs/fixtures").rglob("*.json"))


def _checker():
    spec = importlib.util.spec_from_file_location("check_hf_counts", ROOT / "scripts/check_hf_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: str(p.relative_to(ROOT / "tests/specs/fixtures")))
def test_count_equals_transformers(path):
    import torch

    torch.set_num_threads(1)
    result = _checker().check(path)
    if result is None:
        pytest.skip(f"{path.name}: not in transformers or not importable (see the printed reason)")
    assert result is True
