"""The hostile-input sweep: every command over the committed corpus (corpus/, written by make_corpus.py) and over
hostile option values. ``all_cases()`` lists them; ``sweep.py`` prints the counts per class; ``test_fuzz.py``
asserts every case behaves.

plan.json files are never hand-written: ``base_plan()`` saves one with ``piper estimate --save`` at test time and
the corpus's plans/*.json are patches applied to it (dotted path -> value), so the cases follow plan.json's
format as it changes.
"""

from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

from harness import Case

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
ROOT = HERE.parents[1]
TINY = ["--model", "tiny-moe", "--platform", "local-cpu", "--seq", "128", "--global-batch", "8"]
ESTIMATE = ["estimate", *TINY, "--nodes", "1", "--dp", "2", "--ep", "2"]
BIG_DIGITS = 100
"""A digit string longer than this in a patch is the corpus's 5,000-digit integer, written back verbatim."""
PWNED = "piper-fuzz-pwned"


# ---- plan.json and run directories, made at test time ------------------------------------------------
@lru_cache(maxsize=1)
def base_plan_text() -> str:
    """A valid plan.json written by `piper estimate --save` (in-process, once per test session)."""
    import tempfile

    from click.testing import CliRunner

    from piper_plan.cli.main import cli

    path = Path(tempfile.mkdtemp(prefix="piper-fuzz-plan-")) / "plan.json"
    result = CliRunner().invoke(cli, [*ESTIMATE, "--save", str(path)])
    if result.exit_code != 0:
        raise RuntimeError(f"estimate --save failed: {result.output}")
    text = path.read_text()
    shutil.rmtree(path.parent)
    return text


def _read_patch(path: Path) -> dict:
    return json.loads(path.read_text(), parse_int=lambda s: ("BIG", s) if len(s) > BIG_DIGITS else int(s))


def patched_plan_text(patch: dict) -> str:
    """base_plan_text() with each dotted path set to its value ([] / {} / scalars; 'BIG' ints kept verbatim)."""
    data = json.loads(base_plan_text())
    bigs = {}
    for dotted, value in patch.items():
        if isinstance(value, list) and len(value) == 2 and value[0] == "BIG":
            bigs[f"__big{len(bigs)}__"] = value[1]
            value = f"__big{len(bigs) - 1}__"
        value = json.loads(json.dumps(value).replace("{root}", str(ROOT)))
        _set_path(data, dotted, value)
    text = json.dumps(data, indent=1, allow_nan=True)
    for marker, digits in bigs.items():
        text = text.replace(f'"{marker}"', digits)
    return text


def _set_path(data, dotted: str, value) -> None:
    node = data
    keys = dotted.split(".")
    for key in keys[:-1]:
        if isinstance(node, list):
            node = node[int(key)]
        else:
            if not isinstance(node.get(key), (dict, list)):
                node[key] = {}
            node = node[key]
    if isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value


GOOD_METRICS = "\n".join(json.dumps({"schema_version": 1, "step": s, "loss": 6.0, "step_time_s": 2.0 + s / 10,
                                     "tokens": 1024, "tokens_per_s": 1024 / (2.0 + s / 10), "time_s": {"a2a": 0.2},
                                     "memory_bytes": [{"total_bytes": 3.0e8, "source": "x"}]})
                         for s in (1, 2, 3)) + "\n"


def run_dir(plan_text: str | None = None, metrics: bytes | None = None, name: str = "run", patch: dict | None = None):
    """A setup writing {tmp}/<name>/plan.json (``plan_text``, else the base plan with ``patch``) and metrics.jsonl
    (the good one unless given). The plan is made when the case runs, not when the cases are listed."""
    def setup(tmp: Path) -> None:
        d = tmp / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "plan.json").write_text(plan_text if plan_text is not None else patched_plan_text(patch or {}))
        (d / "metrics.jsonl").write_bytes(metrics if metrics is not None else GOOD_METRICS.encode())
    return setup


def plan_file(patch: dict | None = None):
    def setup(tmp: Path) -> None:
        (tmp / "plan.json").write_text(patched_plan_text(patch or {}))
    return setup


# ---- a PIPER_HOME with a poisoned calibration folder ---------------------------------------------------
def piper_home(tmp: Path) -> Path:
    """{tmp}/home: the catalog's models/ and platforms/ and a copy of calibration/local-cpu; returns that copy."""
    home = tmp / "home"
    home.mkdir()
    for name in ("models", "platforms"):
        (home / name).symlink_to(ROOT / name)
    cal = home / "calibration" / "local-cpu"
    shutil.copytree(ROOT / "calibration" / "local-cpu", cal)
    return cal


def poisoned_home(file: str, text: str | None, mode: str):
    """Setup: {tmp}/home with the catalog's models/ and platforms/ and a copy of calibration/local-cpu with one
    file poisoned ('row': a row appended; 'file': replaced; 'directory'; 'not-utf8'; 'duplicate'; 'overhead-nan';
    'huge-field'; 'many-rows')."""
    def setup(tmp: Path) -> None:
        target = piper_home(tmp) / file
        if mode == "row":
            target.write_text(target.read_text().rstrip("\n") + "\n" + text + "\n")
        elif mode == "file":
            target.write_text(text)
        elif mode == "directory":
            target.unlink(missing_ok=True)
            target.mkdir()
        elif mode == "not-utf8":
            target.write_bytes(target.read_bytes() + b"cpu,fp32,9,9,9,1,0.1,1.0,caf\xe9\n")
        elif mode == "duplicate":
            lines = target.read_text().splitlines()
            target.write_text("\n".join(lines + [lines[1]]) + "\n")
        elif mode == "huge-field":     # one field beyond csv's 131,072-character limit
            target.write_text(target.read_text() + "cpu,fp32,64,64,71,1,0.1,1.0," + "x" * 200_000 + "\n")
        elif mode == "many-rows":      # more points than a calibration table may hold (calibration.io.MAX_ROWS)
            rows = "".join(f"cpu,fp32,{m},64,64,1,0.1,1.0,measured: fuzz\n" for m in range(1, 10_002))
            target.write_text(target.read_text().splitlines()[0] + "\n" + rows)
        elif mode == "overhead-nan":
            lines = target.read_text().splitlines()
            fields = lines[1].split(",")
            idx = lines[0].split(",").index("seconds")
            fields[idx] = "nan"
            target.write_text("\n".join(lines + [",".join(fields)]) + "\n")
    return setup


def huge_file(name: str, head: bytes, size: int):
    """Setup: {tmp}/<name>, ``size`` bytes (a file larger than the reader's limit; made here, not committed)."""
    def setup(tmp: Path) -> None:
        with open(tmp / name, "wb") as f:
            f.write(head)
            f.truncate(size)
    return setup


def _no_pwned(tmp: Path, outcome) -> str | None:
    """The template injection check: no job script holds the corpus's injected command."""
    for script in tmp.rglob("*.sbatch"):
        if PWNED in script.read_text(errors="replace"):
            return "silent_accept"
    if PWNED in outcome.stdout:
        return "silent_accept"
    return None


# ---- the cases -----------------------------------------------------------------------------------------
HUGE_LAYERS = ("num_layers-1e7", "num_layers-1e9", "num_layers-1e18")
"""Model files that hung or exhausted memory before the limits: run as child processes with a memory cap."""


def model_cases() -> list[Case]:
    cases = []
    for path in sorted((CORPUS / "models").iterdir()):
        big = path.stem in HUGE_LAYERS
        cases.append(Case(f"model-show/{path.name}", ["model", "show", str(path), "--json"], subprocess=big))
        cases.append(Case(f"estimate-model/{path.name}",
                          ["estimate", "--model", str(path), "--platform", "local-cpu", "--nodes", "1", "--seq", "128",
                           "--global-batch", "8", "--json"], subprocess=big))
        if big or "deep" in path.name or "bigint" in path.name or "true" in path.name:
            cases.append(Case(f"plan-model/{path.name}",
                              ["plan", "--model", str(path), "--platform", "local-cpu", "--nodes", "1", "--seq", "128",
                               "--global-batch", "8", "--json"], subprocess=big))
    cases.append(Case("model-show/missing", ["model", "show", "{tmp}/nope.yaml"]))
    cases.append(Case("model-show/directory", ["model", "show", "{tmp}/d.yaml"], setup=lambda t: (t / "d.yaml").mkdir()))
    cases.append(Case("model-show/unknown-name", ["model", "show", "no-such-model"]))
    cases.append(Case("model-show/huge-file", ["model", "show", "{tmp}/big.yaml"],
                      setup=huge_file("big.yaml", b"name: a\nsource: x\nnotes: '", 40 * 2**20)))
    return cases


def platform_cases() -> list[Case]:
    cases = []
    for path in sorted((CORPUS / "platforms").iterdir()):
        expect_plan = 3 if path.stem == "memory-one-byte" else 2
        if path.stem != "memory-one-byte":
            cases.append(Case(f"platform-show/{path.name}", ["platform", "show", str(path), "--json"]))
            cases.append(Case(f"estimate-platform/{path.name}",
                              ["estimate", "--model", "tiny-moe", "--platform", str(path), "--nodes", "2", "--dp", "4",
                               "--ep", "2", "--seq", "128", "--global-batch", "8", "--json"]))
        cases.append(Case(f"plan-platform/{path.name}",
                          ["plan", "--model", "tiny-moe", "--platform", str(path), "--nodes", "2", "--seq", "128",
                           "--global-batch", "8", "--json"], expect=expect_plan))
    cases.append(Case("platform-show/missing", ["platform", "show", "{tmp}/nope.yaml"]))
    cases.append(Case("platform-show/unknown-name", ["platform", "show", "frontierr"]))
    return cases


def hf_cases() -> list[Case]:
    cases = []
    for path in sorted((CORPUS / "hf").iterdir()):
        cases.append(Case(f"model-import/{path.name}", ["model", "import", str(path), "--json"],
                          subprocess="1e9" in path.name))
        cases.append(Case(f"model-import-out/{path.name}", ["model", "import", str(path), "-o", "{tmp}/m.yaml"],
                          outputs=("{tmp}/m.yaml",), subprocess="1e9" in path.name))
    cases.append(Case("model-import/directory", ["model", "import", "{tmp}"]))
    cases.append(Case("model-import/missing", ["model", "import", "{tmp}/config.json"]))
    return cases


IMPORT = ["calibrate", "import-nccl-tests", "--op", "all_to_all", "--nodes", "1", "--ranks-per-node", "2",
          "--scope", "node", "--platform", "frontier", "--out", "{tmp}/cal"]


def _good_log(tmp: Path) -> None:
    from make_corpus import NCCL_HEADER, nccl_line

    (tmp / "good.txt").write_text(NCCL_HEADER + nccl_line("1024", "10.1", "0.10", "0.19") + nccl_line())


def nccl_cases() -> list[Case]:
    cases = [Case(f"import-nccl/{p.name}", [*IMPORT[:2], str(p), *IMPORT[2:], "--json"],
                  outputs=("{tmp}/cal/collectives.csv",)) for p in sorted((CORPUS / "nccl").iterdir())]
    good = ["calibrate", "import-nccl-tests", "{tmp}/good.txt", "--platform", "frontier"]
    opts = ["--op", "all_to_all", "--ranks-per-node", "2"]
    cases += [
        Case("import-nccl/directory", ["calibrate", "import-nccl-tests", "{tmp}", *IMPORT[2:]]),
        Case("import-nccl/missing", ["calibrate", "import-nccl-tests", "{tmp}/none.txt", *IMPORT[2:]]),
        Case("import-nccl/op-bogus", [*good, "--op", "bcast", "--nodes", "1", "--ranks-per-node", "2", "--scope", "node",
                                      "--out", "{tmp}/cal"], setup=_good_log, outputs=("{tmp}/cal/collectives.csv",)),
        Case("import-nccl/scope-bogus", [*good, *opts, "--nodes", "1", "--scope", "galaxy", "--out", "{tmp}/cal"],
             setup=_good_log, outputs=("{tmp}/cal/collectives.csv",)),
        Case("import-nccl/scope-node-2-nodes", [*good, *opts, "--nodes", "2", "--scope", "node", "--out", "{tmp}/cal"],
             setup=_good_log, outputs=("{tmp}/cal/collectives.csv",)),
        Case("import-nccl/scope-switch-1-node", [*good, *opts, "--nodes", "1", "--scope", "switch", "--out", "{tmp}/cal"],
             setup=_good_log, outputs=("{tmp}/cal/collectives.csv",)),
        Case("import-nccl/bogus-platform-with-out", [*good, *opts, "--nodes", "1", "--scope", "node", "--platform",
                                                     "no-such-platform", "--out", "{tmp}/cal"],
             setup=_good_log, outputs=("{tmp}/cal/collectives.csv",)),
        Case("import-nccl/ranks-zero", [*good, "--op", "all_to_all", "--ranks-per-node", "0", "--nodes", "1",
                                        "--scope", "node", "--out", "{tmp}/cal"], setup=_good_log),
        Case("import-nccl/ranks-over-the-node", [*good, "--op", "all_to_all", "--ranks-per-node", "16", "--nodes", "1",
                                                 "--scope", "node", "--out", "{tmp}/cal"], setup=_good_log,
             outputs=("{tmp}/cal/collectives.csv",)),
        Case("import-nccl/nodes-over-the-platform", [*good, *opts, "--nodes", "20000", "--scope", "system", "--out",
                                                     "{tmp}/cal"], setup=_good_log, outputs=("{tmp}/cal/collectives.csv",)),
        Case("import-nccl/out-is-file", [*good, *opts, "--nodes", "1", "--scope", "node", "--out", "{tmp}/good.txt"],
             setup=_good_log),
        Case("import-nccl/huge-file", ["calibrate", "import-nccl-tests", "{tmp}/big.txt", *IMPORT[2:]],
             setup=huge_file("big.txt", b"# size count type\n", 200 * 2**20), outputs=("{tmp}/cal/collectives.csv",)),
        Case("import-nccl/repair-poisoned", [*good, *opts, "--nodes", "1", "--scope", "node", "--out", "{tmp}/cal"],
             expect=0, setup=_poisoned_then_good),
    ]
    return cases


def _poisoned_then_good(tmp: Path) -> None:
    """A collectives.csv holding the NaN row an older piper wrote, then a good log to re-import over it."""
    _good_log(tmp)
    cal = tmp / "cal"
    cal.mkdir()
    (cal / "collectives.csv").write_text(
        "op,scope,num_nodes,ranks_per_node,bytes_per_rank,seconds,algbw_GBps,busbw_GBps,source\n"
        "all_to_all,node,1,2,1048576,nan,nan,nan,imported: nccl-tests output bad.txt\n")


def calibration_cases() -> list[Case]:
    poison = json.loads((CORPUS / "calibration" / "poison.json").read_text())
    cases = []
    for name, p in poison.items():
        setup = poisoned_home(p["file"], p["text"], p["mode"])
        env = {"PIPER_HOME": "{tmp}/home"}
        cases.append(Case(f"calibrate-show/{name}", ["calibrate", "show", "--platform", "{tmp}/home/calibration/local-cpu",
                                                     "--json"], setup=setup))
        cases.append(Case(f"estimate-calibration/{name}", [*ESTIMATE, "--json"], setup=setup, env=env))
        cases.append(Case(f"plan-calibration/{name}", ["plan", *TINY, "--nodes", "1", "--json"], setup=setup, env=env))
    return cases


def compare_cases() -> list[Case]:
    cases = []
    for path in sorted((CORPUS / "metrics").iterdir()):
        setup = run_dir(metrics=path.read_bytes())
        cases.append(Case(f"compare-metrics/{path.name}", ["compare", "{tmp}/run", "--json"], setup=setup))
        cases.append(Case(f"fit-metrics/{path.name}", ["calibrate", "fit", "{tmp}/run", "--dry-run", "--json",
                                                       "--param", "a2a_overlap"],
                          setup=setup, env={"PIPER_HOME": str(ROOT)}))
    for path in sorted((CORPUS / "plans").iterdir()):
        if path.stem.startswith(("prediction-", "schema-")):
            setup = run_dir(patch=_read_patch(path))
            cases.append(Case(f"compare-plan/{path.name}", ["compare", "{tmp}/run", "--json"], setup=setup))
    cases += [
        Case("compare/empty-dir", ["compare", "{tmp}"]),
        Case("compare/plan-not-json", ["compare", "{tmp}/run"], setup=run_dir(plan_text="{")),
        Case("compare/plan-deep", ["compare", "{tmp}/run"],
             setup=run_dir(plan_text=(CORPUS / "models" / "model-json-deep.json").read_text())),
        Case("compare/plan-bigint", ["compare", "{tmp}/run"],
             setup=run_dir(plan_text=(CORPUS / "models" / "model-json-bigint.json").read_text())),
        Case("compare/metrics-huge", ["compare", "{tmp}"],
             setup=lambda t: (run_dir()(t), huge_file("run/metrics.jsonl", b"{}", 200 * 2**20)(t))),
        Case("fit/param-bogus", ["calibrate", "fit", "{tmp}/run", "--dry-run", "--param", "bogus"], setup=run_dir()),
        Case("fit/three-params-one-run", ["calibrate", "fit", "{tmp}/run", "--dry-run", "--param", "a2a_overlap",
                                          "--param", "dp_overlap", "--param", "overhead.scale"], setup=run_dir()),
        Case("fit/missing-dir", ["calibrate", "fit", "{tmp}/none", "--dry-run"]),
        Case("fit/empty-dir", ["calibrate", "fit", "{tmp}", "--dry-run"]),
    ]
    return cases


LAUNCH = ["launch", "--plan", "{tmp}/plan.json", "--out", "{tmp}/job"]


def launch_cases() -> list[Case]:
    cases = []
    for path in sorted((CORPUS / "plans").iterdir()):
        patch = _read_patch(path)
        cases.append(Case(f"launch-plan/{path.name}", [*LAUNCH, "--json"], setup=plan_file(patch),
                          outputs=("{tmp}/job",), check=_no_pwned))
        if "template" in path.stem or "steps" in path.stem or "prediction-step" in path.stem:
            cases.append(Case(f"launch-plan-dry/{path.name}", [*LAUNCH, "--dry-run"], setup=plan_file(patch),
                              outputs=("{tmp}/job",), check=_no_pwned))
    good = plan_file()
    bad_times = ["00:00:00", "999-99:00:00", "abc", "1:2:3:4", "00:60:00", "-1", "0", "25:00", "99999999:00:00",
                 "1-", "00:00:00\n#SBATCH --uid=0"]
    cases += [Case(f"launch-time/{t!r}", [*LAUNCH, "--time", t], setup=good, outputs=("{tmp}/job",)) for t in bad_times]
    cases += [Case(f"launch-steps/{s}", [*LAUNCH, "--steps", s], setup=good, outputs=("{tmp}/job",))
              for s in ("0", "-5", "1000000000000000", "1e15", "abc")]
    for opt, value in (("--job-name", "a\nb"), ("--job-name", "$(touch /tmp/x)"), ("--account", "x y"),
                       ("--account", "a\n#SBATCH --uid=0"), ("--partition", "p;rm -rf ~"), ("--job-name", "")):
        cases.append(Case(f"launch-opt/{opt}={value!r}", [*LAUNCH, opt, value], setup=good, outputs=("{tmp}/job",)))
    cases += [
        Case("launch/plan-missing", [*LAUNCH], outputs=("{tmp}/job",)),
        Case("launch/plan-directory", ["launch", "--plan", "{tmp}/p", "--out", "{tmp}/job"],
             setup=lambda t: (t / "p").mkdir(), outputs=("{tmp}/job",)),
        Case("launch/out-is-file", ["launch", "--plan", "{tmp}/plan.json", "--out", "{tmp}/plan.json"], setup=good),
        Case("launch/plan-and-model", [*LAUNCH, "--model", "tiny-moe"], setup=good, outputs=("{tmp}/job",)),
        Case("launch/dry-run-submit", [*LAUNCH, "--dry-run", "--submit"], setup=good, outputs=("{tmp}/job",)),
        Case("launch/dry-run-json", [*LAUNCH, "--dry-run", "--json"], expect=0, setup=good),
        Case("launch/plan-not-utf8", [*LAUNCH], setup=lambda t: (t / "plan.json").write_bytes(b"\xff\xfe{}"),
             outputs=("{tmp}/job",)),
        Case("launch/plan-deep", [*LAUNCH], outputs=("{tmp}/job",),
             setup=lambda t: shutil.copy(CORPUS / "models" / "model-json-deep.json", t / "plan.json")),
        Case("launch/plan-duplicate-keys", [*LAUNCH], outputs=("{tmp}/job",),
             setup=lambda t: (t / "plan.json").write_text(base_plan_text().replace('"nodes": 1', '"nodes": 1, "nodes": 2'))),
        Case("launch/plan-huge", [*LAUNCH], outputs=("{tmp}/job",),
             setup=huge_file("plan.json", b"{", 40 * 2**20)),
    ]
    return cases


def option_cases() -> list[Case]:
    est = ["estimate", *TINY]
    cases = [Case(f"estimate-opt/{' '.join(extra)}", [*est, *extra, "--json"]) for extra in (
        ["--nodes", "0"], ["--nodes", "-1"], ["--nodes", "100000000"], ["--nodes", "1", "--dp", "0"],
        ["--nodes", "1", "--dp", "3"], ["--nodes", "1", "--pp", "0"], ["--nodes", "1", "--ep", "3"],
        ["--nodes", "1", "--mbs", "0"], ["--nodes", "1", "--seq", "0"], ["--nodes", "1", "--seq", "1000000000000"],
        ["--nodes", "1", "--global-batch", "0"], ["--nodes", "1", "--dp", "2", "--routing-skew", "nan"],
        ["--nodes", "1", "--dp", "2", "--routing-skew", "inf"], ["--nodes", "1", "--dp", "2", "--routing-skew", "0.5"],
        ["--nodes", "1", "--dp", "2", "--virtual-stages", "0"], ["--nodes", "1", "--dp", "2", "--etp", "2"],
        ["--nodes", "1", "--dp", "2", "--schedule", "interleaved"], ["--nodes", "1", "--dp", "2", "--seq", "4096"],
        ["--nodes", "1", "--dp", "2", "--tp", "2", "--etp", "2", "--ep", "1"], ["--nodes", "20000", "--dp", "40000"],
        ["--nodes", "1", "--dp", "2", "--capacity-factor", "nan"], ["--nodes", "1", "--dp", "2", "--capacity-factor",
                                                                    "1e400"],
        ["--nodes", "1", "--dp", "2", "--capacity-factor", "-1"], ["--nodes", "1", "--dp", "2", "--capacity-factor", ""],
    )]
    cases += [
        Case("estimate-opt/save-directory", [*ESTIMATE, "--save", "{tmp}"]),
        Case("estimate-opt/save-under-file", [*ESTIMATE, "--save", "{tmp}/f/plan.json"],
             setup=lambda t: (t / "f").write_text("x")),
        Case("estimate-opt/model-missing", ["estimate", "--model", "{tmp}/none.yaml", "--platform", "local-cpu",
                                            "--nodes", "1"]),
        Case("estimate-opt/platform-unknown", ["estimate", "--model", "tiny-moe", "--platform", "nowhere", "--nodes", "1"]),
        Case("estimate-opt/model-empty", ["estimate", "--model", "", "--platform", "local-cpu", "--nodes", "1"]),
    ]
    plan = ["plan", *TINY]
    cases += [Case(f"plan-opt/{' '.join(extra)}", [*plan, *extra, "--json"], expect=exit_) for extra, exit_ in (
        (["--nodes", "abc"], 2), (["--nodes", "0"], 2), (["--nodes", "-1"], 2), (["--nodes", "8..4"], 2),
        (["--nodes", "1..100000000"], 0), (["--nodes", "5..100000000"], 2), (["--nodes", "1...2"], 2), (["--nodes", "1e3"], 2),
        (["--nodes", "100000000"], 2), (["--nodes", "1", "--seq", "1000000000000"], 2), (["--nodes", "1", "--seq", "0"], 2),
        (["--nodes", "1", "--global-batch", "0"], 2), (["--nodes", "1", "--memory-headroom", "1.5"], 2),
        (["--nodes", "1", "--memory-headroom", "-0.1"], 2), (["--nodes", "1", "--memory-headroom", "nan"], 2),
        (["--nodes", "1", "--top", "-1"], 2), (["--nodes", "1", "--save", "{tmp}"], 2),
        (["--nodes", "1", "--memory-headroom", "0.99"], 3),
    )]
    cases.append(Case("plan-opt/frontier-headroom-0.99", ["plan", "--model", "mixtral-8x7b", "--platform", "frontier",
                                                          "--nodes", "8", "--memory-headroom", "0.99"],
                      expect=3, subprocess=True))
    cases.append(Case("plan-opt/frontier-one-byte-memory", ["plan", "--model", "mixtral-8x7b", "--platform",
                                                            "{tmp}/f.yaml", "--nodes", "8"],
                      expect=3, subprocess=True, setup=_one_byte_frontier))
    cases.append(Case("plan-opt/headroom-0.99-subprocess", [*plan, "--nodes", "1", "--memory-headroom", "0.99"],
                      expect=3, subprocess=True))
    for path in sorted((CORPUS / "validation").iterdir()):
        cases.append(Case(f"validate/{path.name}", ["validate", "--dataset", str(path), "--json"]))
    cases.append(Case("validate/missing", ["validate", "--dataset", "{tmp}/none.yaml"]))
    cases.append(Case("calibrate-show/unknown", ["calibrate", "show", "--platform", "nowhere"]))
    cases.append(Case("calibrate-show/empty-dir", ["calibrate", "show", "--platform", "{tmp}"]))
    return cases


ARGUABLY_VALID = {
    "model-import/architectures-string.json": "architectures is not read by the import (model_type decides)",
    "model-import-out/architectures-string.json": "architectures is not read by the import (model_type decides)",
    **{f"{cmd}/gemm-header-only": "a header-only gemm.csv is an empty table: show lists it as such; estimate and "
                                  "plan price GEMMs at the roofline and say so (sources.compute: 'gemm.csv has no "
                                  "<dtype> rows'), as for a calibration measured in another precision"
       for cmd in ("calibrate-show", "estimate-calibration", "plan-calibration")},
    "launch-plan/data-dollar.json": "runtime.data never reaches the job script (the runtime reads it from plan.json "
                                    "and opens it as a path); the check asserts the script does not hold it",
    **{f"{cmd}/{name}": "fit.csv is read by no command (only by fit.load_fit, tested in tests/fuzz/test_readers.py)"
       for cmd in ("calibrate-show", "estimate-calibration", "plan-calibration")
       for name in ("fit-nan", "fit-bogus-parameter", "fit-malformed")},
}
"""Cases whose input the sweep accepts on purpose, with the argument why (exit 0 is right for them)."""


def _one_byte_frontier(tmp: Path) -> None:
    import yaml

    data = yaml.safe_load((ROOT / "platforms" / "frontier.yaml").read_text())
    data["device"]["memory_bytes"] = 1
    (tmp / "f.yaml").write_text(yaml.safe_dump(data))


EXPORT = ["export", "--engine", "torchtitan", "{tmp}/plan.json", "-o", "{tmp}/job.sh"]


def export_cases() -> list[Case]:
    """piper export and --plot: a plan file that cannot be read, a model or degree the engine lacks, bad paths."""
    deep = CORPUS / "models" / "model-json-deep.json"
    return [
        Case("export/plan-missing", EXPORT, outputs=("{tmp}/job.sh",)),
        Case("export/plan-not-utf8", EXPORT, setup=lambda t: (t / "plan.json").write_bytes(b"\xff\xfe{}"),
             outputs=("{tmp}/job.sh",)),
        Case("export/plan-deep", EXPORT, setup=lambda t: shutil.copy(deep, t / "plan.json"), outputs=("{tmp}/job.sh",)),
        Case("export/model-torchtitan-lacks", EXPORT, setup=plan_file(), outputs=("{tmp}/job.sh",)),
        Case("export/out-is-dir", [*EXPORT[:-1], "{tmp}"], setup=plan_file()),
        Case("export/engine-bogus", ["export", "--engine", "deepspeed", "{tmp}/plan.json"], setup=plan_file()),
        Case("plot/not-png", ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--plot",
                              "{tmp}/x.txt"], outputs=("{tmp}/x.txt",)),
        Case("plot/under-a-file", ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                   "--dp", "2", "--ep", "2", "--plot", "{tmp}/plan.json/x.png"], setup=plan_file()),
    ]


def all_cases() -> list[Case]:
    cases = (model_cases() + platform_cases() + hf_cases() + nccl_cases() + calibration_cases() + compare_cases()
             + launch_cases() + option_cases() + export_cases())
    for case in cases:
        if case.id in ARGUABLY_VALID:
            case.expect = 0
    ids = [c.id for c in cases]
    dupes = {i for i in ids if ids.count(i) > 1}
    assert not dupes, dupes
    return cases
