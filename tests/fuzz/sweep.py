"""Run the whole hostile-input sweep and print the count per outcome class (and each failing case).

    .venv/bin/python tests/fuzz/sweep.py            # the table
    .venv/bin/python tests/fuzz/sweep.py -v         # and one line per case that is not ok
    .venv/bin/python tests/fuzz/sweep.py --json     # the counts as JSON

The same cases run under pytest as the ``fuzz`` tier (tests/fuzz/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cases import all_cases  # noqa: E402
from harness import CLASSES, describe, run_case  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("-k", default="", help="only cases whose id contains this")
    args = parser.parse_args()
    cases = [c for c in all_cases() if args.k in c.id]
    counts, failures, slowest = Counter(), [], (0.0, "")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="piper-sweep-") as root:
        for i, case in enumerate(cases):
            tmp = Path(root) / f"case{i}"
            outcome = run_case(case, tmp)
            verdict = outcome.classify(case, tmp)
            counts[verdict] += 1
            slowest = max(slowest, (outcome.seconds, case.id))
            if verdict != "ok":
                failures.append(describe(case, outcome, verdict))
    wall = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"cases": len(cases), "wall_s": round(wall, 1), **{c: counts[c] for c in CLASSES}}))
    else:
        print(f"{len(cases)} cases in {wall:.0f} s (slowest {slowest[0]:.1f} s: {slowest[1]})")
        print("| class | cases |\n| --- | --- |")
        for c in CLASSES:
            print(f"| {c} | {counts[c]} |")
    if args.verbose:
        print("\n".join(failures))


if __name__ == "__main__":
    main()
