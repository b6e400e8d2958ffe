"""The fuzz tier's helpers (harness, cases, make_corpus) import each other by module name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hypothesis import settings  # noqa: E402

settings.register_profile("fuzz-stress", max_examples=1000)


def pytest_collection_modifyitems(config, items):
    """A marker filter that does not name ``fuzz`` (the fast tier: -m "not slurm and not distributed") leaves the
    fuzz tier out; no filter (the whole suite) or one naming fuzz (-m fuzz) runs it."""
    expr = config.getoption("markexpr") or ""
    if not expr or "fuzz" in expr:
        return
    keep = [item for item in items if item.get_closest_marker("fuzz") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("fuzz") is not None])
        items[:] = keep
