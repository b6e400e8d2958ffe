"""Rank 0's progress line (runtime/metrics.py): step, loss, tokens/s, ETA; live on a terminal, plain otherwise."""

from __future__ import annotations

import io

from piper_plan.runtime.metrics import ProgressLine, eta_s, hms, progress_line, step_record


def record(step: int, seconds: float = 2.0, loss: float = 6.25):
    return step_record(step, loss, seconds, 4096, {"a2a": 0.0, "p2p": 0.0, "dp_sync": 0.0}, [], {})


def test_line_reads_as_words():
    assert progress_line(record(12), 200, 188 * 2.0) == "step 12/200 | loss 6.2500 | 2,048 tokens/s | ETA 6m16s"
    assert progress_line(record(1), 5, None).endswith("ETA -")
    assert [hms(s) for s in (0, 12, 192, 3725)] == ["0s", "12s", "3m12s", "1h02m05s"]


def test_eta_leaves_out_the_warm_up_step():
    assert eta_s([], 10) is None
    assert eta_s([9.0], 4) == 36.0                       # nothing else to go by yet
    assert eta_s([9.0, 1.0, 3.0], 5) == 10.0             # mean of the steady steps x steps left


def test_plain_lines_every_n_steps_and_at_the_last():
    out = io.StringIO()
    progress = ProgressLine(7, out, every=3, is_terminal=False)
    for step in range(1, 8):
        progress.update(record(step))
    progress.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == ["step 3/7", "step 6/7", "step 7/7"]
    assert "\r" not in out.getvalue() and lines[-1].endswith("ETA 0s")


def test_live_line_is_rewritten_in_place_and_ended():
    out = io.StringIO()
    progress = ProgressLine(10, out, is_terminal=True)
    for step in (1, 2):
        progress.update(record(step))
    progress.close()                                     # stopped before the last step (a signal)
    text = out.getvalue()
    assert text.count("\r\x1b[2K") == 2 and text.endswith("ETA 16s\n") and text.count("\n") == 1
