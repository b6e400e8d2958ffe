"""Rendering is pure: parse the emitted #SBATCH lines and srun line and check every count against the plan."""

import re
import shlex
import subprocess
import sys

import pytest

from launch_plans import write_plan
from piper_plan.errors import PiperError
from piper_plan.launch import render
from piper_plan.launch.job import prepare
from piper_plan.launch.render import LaunchOptions
from piper_plan.planfile import read_plan_file
from piper_plan.specs import ParallelPlan


def sbatch_options(script: str) -> dict[str, str]:
    """'#SBATCH --key=value' lines -> {key: value} ('' for flags)."""
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].strip().lstrip("-").partition("=")
            out[key] = value
    return out


def srun_words(script: str) -> list[str]:
    """The words of the training srun command (continuation lines joined)."""
    text = script.replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("srun -N") and "piper_plan" in ln)
    return shlex.split(line.rsplit("&", 1)[0])          # the trailing " &" (a path may hold one)


def render_for(tmp_path, platform, nodes, parallel, model="tiny-moe", **opts):
    plan = write_plan(tmp_path / "src.json", platform, nodes, parallel, model=model)
    return prepare(plan, tmp_path / "job", LaunchOptions(**opts), python=sys.executable)


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_frontier_counts_come_from_the_plan(tmp_path, nodes):
    # world = nodes x 8 GCDs; pp=2 -> dp = 4 x nodes; ep = 8 fits inside one node (consecutive ranks)
    prepared = render_for(tmp_path, "frontier", nodes, {"pp": 2, "dp": 4 * nodes, "ep": 4 * nodes if nodes == 1 else 8})
    opts = sbatch_options(prepared.script)
    assert opts["nodes"] == str(nodes)
    assert opts["ntasks-per-node"] == "8" and opts["cpus-per-task"] == "7" and opts["gpus-per-task"] == "1"
    assert opts["partition"] == "batch" and opts["signal"] == f"B:USR1@{render.SIGNAL_LEAD_S}" and "requeue" in opts
    assert "switches" not in opts  # every expert group lies inside one node
    words = srun_words(prepared.script)
    assert words[words.index("-n") + 1] == str(8 * nodes)
    assert words[words.index("-N") + 1] == str(nodes)
    assert "--gpu-bind=closest" in words and words[words.index("-c") + 1] == "7"
    assert words[words.index("--steps") + 1] == "4"
    assert "module load rccl-net-plugin" in prepared.script.splitlines()
    assert 'export NCCL_SOCKET_IFNAME="hsn0"' in prepared.script.splitlines()


def test_frontier_switches_when_expert_groups_span_nodes(tmp_path):
    # 8 nodes x 8 = 64 ranks, pp=1, dp=64, ep=16 (switch-base, 128 experts): each expert group spans 2
    # nodes -> ceil(8 / 4) = 2 switches
    prepared = render_for(tmp_path, "frontier", 8, {"dp": 64, "ep": 16}, model="switch-base")
    assert sbatch_options(prepared.script)["switches"] == f"2@{render.SWITCH_WAIT}"


def test_expert_groups_span_nodes():
    assert not render.expert_groups_span_nodes(ParallelPlan(dp=8, ep=8), 8)
    assert render.expert_groups_span_nodes(ParallelPlan(dp=16, ep=16), 8)
    # pp=3 stages of dp=4 on 4-device nodes: stage blocks start at 0, 4, 8 -> aligned, groups of 4 fit
    assert not render.expert_groups_span_nodes(ParallelPlan(pp=3, dp=4, ep=4), 4)
    # 6-rank blocks, ep=3 on 4-device nodes: group [3, 4, 5] crosses node 0 -> node 1
    assert render.expert_groups_span_nodes(ParallelPlan(dp=6, ep=3), 4)


def test_default_time_from_prediction():
    # 2 x 100 steps x 3.0 s + 600 s start-up + 180 s signal lead = 1380 s = 23 min
    assert render.default_time(100, 3.0) == "00:23:00"
    assert render.default_time(1, None) == "00:13:00"  # 780 s -> 13 min
    assert render.default_time(10_000, 10.0) == "55:47:00"  # 200000 + 780 = 200780 s -> 3347 min = 55 h 47 min


def test_options_reach_the_script(tmp_path):
    prepared = render_for(tmp_path, "frontier", 2, {"pp": 2, "dp": 8, "ep": 8}, steps=7, account="CSC123",
                          partition="extended", time="01:30:00", job_name="moe.run-1")
    opts = sbatch_options(prepared.script)
    assert (opts["account"], opts["partition"], opts["time"], opts["job-name"]) == ("CSC123", "extended", "01:30:00", "moe.run-1")
    words = srun_words(prepared.script)
    assert words[words.index("--steps") + 1] == "7"
    assert words[words.index("--plan") + 1] == str(tmp_path / "job" / "plan.json")


@pytest.mark.parametrize("platform,nodes,parallel", [
    ("frontier", 2, {"pp": 2, "dp": 8, "ep": 8}), ("dgx-h100", 2, {"dp": 16, "ep": 8}),
    ("local-cpu", 2, {"pp": 2, "dp": 2, "ep": 2})])
def test_scripts_are_valid_bash(tmp_path, platform, nodes, parallel):
    prepared = render_for(tmp_path, platform, nodes, parallel)
    proc = subprocess.run(["bash", "-n"], input=prepared.script, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert not re.search(r"\{\{[a-z_]+\}\}", prepared.script)


def test_plan_must_fill_its_nodes(tmp_path):
    plan = write_plan(tmp_path / "p.json", "frontier", 1, {"dp": 8, "ep": 8})
    plan.write_text(plan.read_text().replace('"nodes": 1', '"nodes": 2'))
    with pytest.raises(PiperError, match="16"):
        prepare(plan, tmp_path / "job", LaunchOptions(), python=sys.executable)


def test_unknown_placeholder_is_an_error():
    with pytest.raises(PiperError, match="nodez"):
        render.fill_template("#SBATCH --nodes={{nodez}}\n", {"nodes": "2"})


def test_read_plan_keeps_the_degrees(tmp_path):
    plan = read_plan_file(write_plan(tmp_path / "p.json", "frontier", 2, {"pp": 2, "dp": 8, "ep": 4}))
    assert (plan.nodes, plan.parallel.pp, plan.parallel.dp, plan.parallel.ep, plan.parallel.edp) == (2, 2, 8, 4, 2)


@pytest.mark.parametrize("nodes, segment", [(2, 2), (16, 16), (32, 16), (24, 8)])
def test_gb200_jobs_ask_for_rack_aligned_segments(tmp_path, nodes, segment):
    # gb200-nvl72 places jobs in 16-tray segments (network.segment_nodes): a job that fits one segment asks for
    # one; a larger one for the largest segment dividing it (Slurm: a node count above the segment must be a
    # multiple of it); --switches (topology/tree) is not emitted on a block topology
    world = 4 * nodes
    prepared = render_for(tmp_path, "gb200-nvl72", nodes, {"dp": world, "ep": 8})
    opts = sbatch_options(prepared.script)
    assert opts["segment"] == str(segment) and "switches" not in opts
    assert f"--segment={segment}" in prepared.readme
    # 24 nodes are not a multiple of 16: Slurm keeps 8 together, not the 16 + 8 the plan was priced on: said
    short = nodes % 16 != 0 and nodes > 16
    assert (prepared.job.segment_warning is not None) == short
    assert ("as the plan was priced" in prepared.readme) != short
    if short:
        assert "16 or 32 nodes keep whole segments" in prepared.job.segment_warning


def test_segment_size():
    assert [render.segment_size(n, 16) for n in (1, 12, 16, 17, 32, 48, 40)] == [1, 12, 16, 1, 16, 16, 8]


@pytest.mark.parametrize("model_name,nodes,expected", [
    ("mixtral-8x7b", 4, "piper-mixtral-8x7b-4n"), ("../../etc", 4, "piper-..-..-etc-4n"),
    ("Qwen3 30B (A3B)", 2, "piper-Qwen3-30B-A3B-2n"), ("$$$", 1, "piper-model-1n"), ("x" * 300, 1024, None)])
def test_default_job_name_is_a_valid_job_name(model_name, nodes, expected):
    """A model's name may be any printable line; the job name piper derives from it is always one sbatch takes."""
    from piper_plan.launch import validate
    name = validate.default_job_name(model_name, nodes)
    assert validate.job_name(name) == name and name.endswith(f"-{nodes}n")
    assert expected is None or name == expected


@pytest.mark.parametrize("platform, shown, absent", [("h200", "# Platform: h200: NVIDIA H200 SXM nodes", "H100 SXM5"),
                                                     ("mi355x", "# Platform: mi355x: ", None)])
def test_a_shared_template_names_the_plans_own_platform(tmp_path, platform, shown, absent):
    """h200 renders the DGX H100 template, whose header once said '8 x H100 SXM5 per node' (a second consistency
    pass); its first lines now carry the platform's own name and description."""
    prepared = render_for(tmp_path, platform, 1, {"dp": 8, "ep": 8})
    header = prepared.script.split("#SBATCH")[0]
    assert shown in header and (absent is None or absent not in header)


def sbatch_arguments(line: str) -> list[str]:
    """The arguments sbatch reads from one '#SBATCH ...' line, as src/sbatch/opt.c's _get_argument reads them
    (Slurm >= 17.11): whitespace splits outside quotes, '"' and "'" quote, a backslash escapes the next character,
    an unescaped '#' outside quotes ends the line."""
    args, word, quote, escape, started = [], [], None, False, False
    for char in line[len("#SBATCH"):] + " ":
        if escape:
            word.append(char)
            escape = False
        elif char == "\\":
            escape = started = True
        elif quote:
            word += [] if char == quote else [char]
            quote = None if char == quote else quote
        elif char in "\"'":
            quote, started = char, True
        elif char == "#" or char.isspace():
            if started:
                args.append("".join(word))
            word, started = [], False
            if char == "#":
                break
        else:
            word.append(char)
            started = True
    assert quote is None, f"sbatch: unmatched {quote} in {line!r}"
    return args


@pytest.mark.parametrize("folder", ["my runs", "ünï", "jöb$HOME;x`id`", "it's", "(x) & y"])
def test_a_job_directory_sbatch_and_bash_read_back_as_written(tmp_path, folder):
    """`piper launch` refused every job directory outside [A-Za-z0-9._/+@,=~-] ('ü' is a letter); the path now
    reaches #SBATCH --chdir / --output as sbatch reads a word (quoted where needed) and the body shell-quoted."""
    out = tmp_path / folder / "job"
    plan = write_plan(tmp_path / "src.json", "local-cpu", 1, {"dp": 2})
    prepared = prepare(plan, out, LaunchOptions(), python="/opt/my venv/bin/python")
    read = {}
    for line in prepared.script.splitlines():
        if line.startswith("#SBATCH"):
            for arg in sbatch_arguments(line):
                key, _, value = arg.lstrip("-").partition("=")
                read[key] = value
    assert read["chdir"] == str(out) and read["output"] == f"{out}/slurm-%j.out"
    assert subprocess.run(["bash", "-n"], input=prepared.script, text=True).returncode == 0
    words = srun_words(prepared.script)
    assert words[words.index("--plan") + 1] == f"{out}/plan.json" and words[words.index("--out") + 1] == f"{out}/run"
    assert "/opt/my venv/bin/python" in words
    assert f"sbatch {shlex.quote(str(out / 'job.sbatch'))}" in prepared.readme


@pytest.mark.parametrize("folder, why", [("a%j", "file-name pattern"), ("a\\b", "backslash"),
                                          ("a\"b", "double quote or '#'"), ("a#b", "double quote or '#'"),
                                          ("my-HetJob", "heterogeneous-job"), ("packjob", "heterogeneous-job"),
                                          ("a\tb", "control character"), ("a\nb", "newline")])
def test_a_job_directory_sbatch_cannot_read_is_refused_with_the_reason(tmp_path, folder, why):
    plan = write_plan(tmp_path / "src.json", "local-cpu", 1, {"dp": 2})
    with pytest.raises(PiperError, match=why) as info:
        prepare(plan, tmp_path / folder, LaunchOptions(), python=sys.executable)
    assert str(info.value).startswith("--out-dir: --out-dir=") and "allowed: an absolute path" in str(info.value)


def test_the_interpreter_is_refused_only_where_bash_cannot_hold_it(tmp_path):
    plan = write_plan(tmp_path / "src.json", "local-cpu", 1, {"dp": 2})
    with pytest.raises(PiperError, match="the Python running piper.*newline"):
        prepare(plan, tmp_path / "job", LaunchOptions(), python="/opt/a\nb/python")


def test_a_template_may_not_write_the_job_directory_into_its_body(tmp_path):
    """out_dir is written for sbatch (double quotes, in which bash expands '$'): a template's body uses run_dir."""
    (tmp_path / "t.sbatch").write_text("#!/bin/bash\n#SBATCH --chdir={{out_dir}}\ncd {{out_dir}}\n")
    with pytest.raises(PiperError, match=r"line 3 uses \{\{out_dir\}\} outside an #SBATCH line"):
        render.load_template("t.sbatch", str(tmp_path))
