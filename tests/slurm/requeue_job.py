"""Run by a Slurm job: stands in for the runtime's fault handling (no torch, so it is quick).

On SIGUSR1 it "checkpoints" (appends a line) and exits 75, as the runtime does; started with --resume it
records that and exits 0. Every start appends {rank, restart, resume} to OUT_DIR/events.jsonl.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = int(os.environ["SLURM_PROCID"])
event = {"rank": rank, "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "resume": "--resume" in sys.argv}


def log(**fields) -> None:
    with open(out / "events.jsonl", "a") as f:
        f.write(json.dumps({**event, **fields}) + "\n")


def on_usr1(signum, frame) -> None:
    log(what="checkpoint")
    sys.exit(75)


signal.signal(signal.SIGUSR1, on_usr1)
log(what="start")
if event["resume"]:
    log(what="done")
    sys.exit(0)
for _ in range(1200):
    time.sleep(0.1)
log(what="no signal")
sys.exit(1)
