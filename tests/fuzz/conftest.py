"""The fuzz tier's helpers (harness, cases, make_corpus) import each other by module name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hypothesis import settings  # noqa: E402

settings.register_profile("fuzz-stress", max_examples=1000)
