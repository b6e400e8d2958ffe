"""piper export: torchtitan 0.3 launches checked by torchtitan's own ConfigManager and ParallelDims, Megatron-LM
flags checked against the names read from Megatron-LM's arguments.py (tests/export/megatron_flags.txt)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.export import megatron, torchtitan
from piper_plan.planfile import read_plan_file

HERE = Path(__file__).parent
MEGATRON_FLAGS = {line.strip() for line in (HERE / "megatron_flags.txt").read_text().splitlines()
                  if line.startswith("--")}


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def saved_plan(tmp_path, name: str, *args) -> Path:
    out = tmp_path / f"{name}.json"
    res = run("estimate", *args, "-o", out, "--json")
    assert res.exit_code == 0, res.output
    return out


DEEPSEEK = ("--model", "deepseek-v3", "--platform", "frontier", "--nodes", "128", "--dp", "8", "--tp", "4",
            "--pp", "32", "--ep", "8", "--zero", "1")
PLANS = {
    "deepseek-zero1": DEEPSEEK,
    "gptoss-zero0-interleaved-full": ("--model", "gpt-oss-120b", "--platform", "frontier", "--nodes", "8",
                                      "--dp", "32", "--tp", "1", "--pp", "2", "--ep", "16", "--schedule",
                                      "interleaved", "--virtual-stages", "3", "--recompute", "full", "--a2a", "halo"),
    "qwen3-zero3-selective": ("--model", "qwen3-30b-a3b", "--platform", "frontier", "--nodes", "4", "--dp", "16",
                              "--tp", "2", "--ep", "8", "--zero", "3", "--recompute", "selective"),
    "gpt-oss-pp": ("--model", "gpt-oss-120b", "--platform", "frontier", "--nodes", "8", "--dp", "8", "--tp", "2",
                   "--pp", "4", "--ep", "8", "--zero", "2"),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    return {name: saved_plan(folder, name, *args) for name, args in PLANS.items()}


def test_megatron_flags_are_megatrons(plans):
    for name, path in plans.items():
        written = set(megatron.flags(read_plan_file(path)))
        assert written <= MEGATRON_FLAGS, (name, written - MEGATRON_FLAGS)


def test_megatron_script_carries_the_degrees(plans):
    text = megatron.script(read_plan_file(plans["deepseek-zero1"]))
    for words in ("--tensor-model-parallel-size 4", "--pipeline-model-parallel-size 32",
                  "--expert-model-parallel-size 8", "--micro-batch-size 1", "--global-batch-size", "--bf16",
                  "--use-distributed-optimizer", "--multi-latent-attention", "pretrain_gpt.py"):
        assert words in text


def test_export_cli_writes_an_executable_script(plans, tmp_path):
    out = tmp_path / "job.sh"
    res = run("export", "--engine", "torchtitan", plans["gptoss-zero0-interleaved-full"], "-o", out)
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "--module gpt_oss" in text
    assert "HALO hierarchical all-to-all (this plan uses it)" in text and "activation_checkpoint:full" in text
    assert out.stat().st_mode & stat.S_IXUSR


@pytest.mark.parametrize("args, needle", [
    (("--model", "mixtral-8x7b", "--platform", "frontier", "--nodes", "8", "--dp", "8", "--pp", "8", "--ep", "8"),
     "no registered configuration for model 'mixtral-8x7b'"),
    (("--model", "qwen3-30b-a3b", "--platform", "frontier", "--nodes", "4", "--dp", "16", "--tp", "2", "--ep", "8",
      "--etp", "2"), "etp=2"),
])
def test_torchtitan_refuses_in_one_line(tmp_path, args, needle):
    plan = saved_plan(tmp_path, "p", *args)
    res = run("export", "--engine", "torchtitan", plan, "-o", tmp_path / "job.sh")
    assert res.exit_code == 2
    errors = [line for line in res.stderr.splitlines() if line]
    assert len(errors) == 1 and needle in errors[0], res.stderr
    assert not (tmp_path / "job.sh").exists()


def test_export_bad_plan_file_is_one_line(tmp_path):
    res = run("export", "--engine", "megatron", tmp_path / "missing.json")
    assert res.exit_code == 2 and "file not found" in res.stderr


# ---- torchtitan's own parser (the export extra) --------------------------------------------------------------
CHECK = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from torchtitan.config.manager import ConfigManager
from torchtitan.distributed.parallel_dims import ParallelDims
out = []
for world, args in json.loads(sys.argv[1]):
    cfg = ConfigManager().parse_args(args)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    spec = cfg.model_spec
    out.append({"dp_shard": dims.dp_shard, "dp_replicate": dims.dp_replicate, "tp": dims.tp, "pp": dims.pp,
                "ep": dims.ep, "local_batch": cfg.training.local_batch_size,
                "global_batch": cfg.training.global_batch_size, "seq_len": cfg.training.seq_len,
                "ac": type(cfg.activation_checkpoint).__qualname__, "mp": cfg.training.mixed_precision_param,
                "schedule": cfg.parallelism.pipeline_parallel_schedule,
                "reshard": cfg.parallelism.fsdp_reshard_after_forward,
                "layers_per_stage": cfg.parallelism.pipeline_parallel_layers_per_stage,
                "layers": len(cfg.model_spec.model.layers)})
print("RESULT " + json.dumps(out))
"""


def torchtitan_parse(cases: list[tuple[int, list[str]]]) -> list[dict]:
    """torchtitan's ConfigManager and ParallelDims on each (world, args), in one fresh interpreter (torchtitan
    imports torch and its models: seconds, paid once)."""
    import json

    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.distributed     # spawns processes (torchtitan's parser in a fresh interpreter, bash -n): not the fast tier
def test_torchtitan_accepts_every_export(plans):
    if os.environ.get("CI") != "true":
        pytest.importorskip("torchtitan")  # the export extra; scripts/install.sh --test installs it
    files = {name: read_plan_file(path) for name, path in plans.items()}
    got = dict(zip(files, torchtitan_parse([(pf.parallel.world, torchtitan.flat_arguments(pf))
                                            for pf in files.values()])))
    for name, pf in files.items():
        p, g = pf.parallel, got[name]
        assert g["dp_shard"] * g["dp_replicate"] == p.dp and (g["tp"], g["pp"], g["ep"]) == (p.tp, p.pp, p.ep), name
        assert g["global_batch"] == pf.training.global_batch and g["seq_len"] == pf.training.seq_len
        # torchtitan's gradient accumulation x local batch x dp covers the global batch exactly
        assert g["global_batch"] % (g["local_batch"] * p.dp) == 0
        assert g["mp"] == "bfloat16"
        assert g["layers"] == pf.model.num_layers, name      # the registered configuration is the same architecture
    assert got["gptoss-zero0-interleaved-full"]["ac"] == "FullAC.Config"
    assert got["gptoss-zero0-interleaved-full"]["schedule"] == "Interleaved1F1B"
    assert got["gptoss-zero0-interleaved-full"]["dp_shard"] == 16       # zero 0, ep 16: the shard axis holds ep (HSDP 2 x 16)
    lps = got["gptoss-zero0-interleaved-full"]["layers_per_stage"]         # torchtitan: ceil((L + 2) / lps) stages
    assert -(-(36 + 2) // lps) == 2 * 3
    assert got["qwen3-zero3-selective"]["ac"] == "SelectiveAC.Config"
    assert got["qwen3-zero3-selective"]["reshard"] == "always"
    assert got["deepseek-zero1"]["ac"] == "NoneType" and got["deepseek-zero1"]["reshard"] == "never"


@pytest.mark.distributed     # spawns bash
@pytest.mark.parametrize("engine", ["torchtitan", "megatron"])
def test_every_export_is_a_valid_bash_script(plans, tmp_path, engine):
    for name, path in plans.items():
        out = tmp_path / f"{name}.sh"
        assert run("export", "--engine", engine, path, "-o", out).exit_code == 0
        assert subprocess.run(["bash", "-n", str(out)]).returncode == 0, name
