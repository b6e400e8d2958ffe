"""Run by a Slurm job (one srun task per rank): gloo all_reduce across emulated nodes; writes rank<k>.json.

Usage: python gloo_allreduce_job.py OUT_DIR [--resume]. Rank, world and local rank come from SLURM_PROCID /
SLURM_NTASKS / SLURM_LOCALID, the rendezvous from MASTER_ADDR / MASTER_PORT (set by the job script).
"""

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", rank=rank, world_size=world)
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
dist.barrier()
record = {"rank": rank, "world": world, "local_rank": int(os.environ["SLURM_LOCALID"]),
          "node": os.environ["SLURMD_NODENAME"], "host": socket.gethostname(), "sum": value.item(),
          "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
