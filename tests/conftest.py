"""Suite-wide settings.

MKL's strict conditional numerical reproducibility (MKL_CBWR=AUTO,STRICT, set before torch loads MKL, and
inherited by every rank process): on AVX-512 machines MKL picks GEMM kernels by the buffers' memory alignment, so
the same product of tensors held at other addresses can differ in the last bit. The runtime's bit-for-bit tests
compare runs whose tensors live in other buffers (live migration moves expert weights and optimizer state). Seen
on an AMD EPYC (AVX-512) host: tests/runtime/test_fsdp_runtime.py::test_migrating_zero3_run_equals_static_run_
bit_for_bit failed (step-2 loss 1.3850560188 against 1.3850558996) at commits 5e64f2a and 4d6298a alike, and
passed with MKL_CBWR=AUTO,STRICT; with MKL_CBWR=COMPATIBLE (not strict) it still failed.

Bytecode caching stays on even where the environment sets PYTHONDONTWRITEBYTECODE.

The suite starts hundreds of `piper` and rank processes; without cached bytecode each recompiles every module it
imports, and pytest re-rewrites every test module's asserts on every run. Measured on the fast tier
(`pytest -m "not slurm and not distributed"`, 3 paired whole-process runs with PYTHONDONTWRITEBYTECODE=1 set):
CPU time 0.94x of the same suite without this file (median; range 0.84-0.96) on a machine shared with other work.

Ctrl-C reaches the tests' processes even where the suite was started with SIGINT ignored (a background job of a
shell without job control, nohup): the processes they start inherit an ignored SIGINT, and Python then installs no
KeyboardInterrupt handler, so the tests of Ctrl-C failed there (the Ctrl-C check of
tests/cli/test_bad_input.py::test_what_the_system_refuses_is_one_line_not_a_traceback, run under
`sh -c 'trap "" INT; exec pytest ...'`, 2026-12-05). Python's own handler is put back; a handler is not inherited
across exec, so the processes the tests start get the default disposition."""

import os
import signal
import sys

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

NOT_IN_THE_FAST_TIER = ("fuzz", "bench", "install")
"""Tiers a marker filter leaves out unless it names them: the fuzz sweep (minutes), the micro-benchmarks of this
machine (seconds of measuring each, which a parallel worker would disturb) and the wheel's build and install
(seconds of pip). The fast tier's filter (-m "not slurm and not distributed") names none; no filter (the whole
suite) runs them, and so does one naming them (scripts/test.sh's serial part: -m "slurm or distributed or fuzz or
bench or install")."""


def pytest_collection_modifyitems(config, items):
    expr = config.getoption("markexpr") or ""
    left_out = [name for name in NOT_IN_THE_FAST_TIER if name not in expr]
    if not expr or not left_out:
        return
    out = [item for item in items if any(item.get_closest_marker(name) for name in left_out)]
    if out:
        config.hook.pytest_deselected(items=out)
        dropped = set(map(id, out))
        items[:] = [item for item in items if id(item) not in dropped]
