"""Render the sbatch script of a calibration on N nodes from PlatformSpec.launch (pure text): the GEMM and attention
sweeps on one device of the first node, then the collective sweep over every device of the N nodes."""

from __future__ import annotations

import shlex
from pathlib import Path

from piper_plan.errors import PiperError
from piper_plan.fileio import atomic_write_text


def render_sweep_script(platform, num_nodes: int, out_dir: Path, *, quick: bool = False, account: str | None = None,
                        time_limit: str = "00:30:00", python_cmd: str = "python3",
                        only: tuple[str, ...] = ("gemm", "attention", "collectives"),
                        platform_ref: str | None = None, dtypes: tuple[str, ...] | None = None) -> str:
    """``only``'s GEMM and attention sweeps as one srun task on one device (``piper calibrate --only``), then its
    collective sweep as one srun task per device, RANK/WORLD_SIZE from SLURM_* (bench_collectives reads them; OLCF
    advises srun over torchrun on Frontier), MASTER_ADDR = the job's first node; each resumes (points already in the
    CSVs are skipped). --time and --account are checked like `piper launch`'s (launch/validate.py): no shell
    characters reach the script; --nodes is held to the platform's size as `piper estimate` holds it (plans.py
    nodes_out_of_range). ``platform_ref``: what the job passes as --platform (a platform file's absolute path: the
    nodes know no catalog entry of its name); the platform's name by default. ``dtypes``: the precisions the GEMM and
    attention sweep keeps to (``piper calibrate --dtype``), checked here, not when the job runs."""
    from piper_plan.calibration.sweep import SweepOptions, check_dtypes, check_fp8_peak
    from piper_plan.launch import validate as v

    check_nodes(platform, num_nodes)
    opts = SweepOptions(platform=platform.name, out_dir=out_dir, quick=quick, only=only, dtypes=dtypes)
    check_dtypes(opts, platform.launch.device)
    check_fp8_peak(opts, platform)
    check_python(python_cmd)
    v.sbatch_path(str(out_dir), "--out-dir")       # it is the job's #SBATCH --output folder, which sbatch reads
    v.wall_time(time_limit)
    if account is not None:
        v.slurm_name(account, "account")
    from piper_plan.launch.render import checked_launch_block

    launch, per_node = platform.launch, platform.devices_per_node
    try:
        settings = checked_launch_block(launch)                   # as `piper launch` checks them
    except PiperError as exc:
        raise PiperError(f"platform {platform.name}: {exc.message}", field=exc.field) from None
    tag = "piper-calibrate-" + v.name_token(platform.name, "platform")[:100]
    lines = ["#!/bin/bash", f"#SBATCH --job-name={tag}", f"#SBATCH --nodes={num_nodes}",
             f"#SBATCH --ntasks-per-node={per_node}", f"#SBATCH --time={time_limit}",
             f"#SBATCH --output={v.sbatch_word(f'{out_dir}/{tag}-%j.out')}"]    # beside its rows, not in the cwd
    lines += [f"#SBATCH --partition={settings['partition']}"] if settings["partition"] else []
    lines += [f"#SBATCH --account={account}"] if account else []
    lines += [f"#SBATCH {opt}" for opt in settings["sbatch_extra"]]
    lines += ["", "set -euo pipefail", f"# platform {platform.name}; launch settings: {launch.source!r}"]
    lines += [f"module load {shlex.quote(m)}" for m in settings["modules"]]
    lines += [f'export {k}="{val}"' for k, val in settings["env"]]
    lines += ['export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "export MASTER_PORT=${MASTER_PORT:-29500}", ""]
    quick_flag, ref = ["--quick"] if quick else [], platform_ref or platform.name
    compute = [k for k in only if k != "collectives"]
    if compute:
        cmd = [python_cmd, "-m", "piper_plan.cli.main", "calibrate", "--platform", ref, "--only", ",".join(compute),
               "--out-dir", str(out_dir), "--resume"] + quick_flag + (["--dtype", ",".join(dtypes)] if dtypes else [])
        lines.append(shlex.join(_srun(platform, settings, 1, 1) + cmd))
    if "collectives" in only:
        cmd = [python_cmd, "-m", "piper_plan.calibration.bench_collectives", "--platform", ref, "--out", str(out_dir),
               "--resume"] + quick_flag
        lines.append(shlex.join(_srun(platform, settings, num_nodes, per_node) + cmd))
    return "\n".join(lines) + "\n"


def _srun(platform, settings: dict, num_nodes: int, tasks_per_node: int) -> list[str]:
    """srun of ``tasks_per_node`` tasks on each of ``num_nodes`` nodes, each with its cores (and GPU)."""
    launch = platform.launch
    srun = ["srun", f"--nodes={num_nodes}", f"--ntasks={num_nodes * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}", f"--cpus-per-task={launch.cpus_per_task}"]
    srun += [f"--gpus-per-task={launch.gpus_per_task}"] if launch.gpus_per_task else []
    return srun + list(settings["srun_extra"])


def check_nodes(platform, num_nodes: int) -> None:
    """One error line when the sweep asks for more nodes than the platform has (PlatformSpec.node_limit)."""
    if not 1 <= num_nodes <= platform.node_limit:
        raise PiperError(f"nodes={num_nodes}; {platform.name} has 1 to {platform.node_limit} nodes", field="--nodes")


def check_python(python_cmd: str) -> None:
    """One error line for an empty or blank interpreter (srun would be handed '' as the program to run)."""
    if not python_cmd.strip():
        raise PiperError(f"python={python_cmd!r} is not allowed; allowed: the Python command or path on the nodes "
                         "(e.g. python3, /opt/venv/bin/python)", field="--python")


def write_script(path: Path, text: str) -> Path:
    """Write the script atomically and make it executable."""
    atomic_write_text(path, text)
    path.chmod(0o755)
    return path
