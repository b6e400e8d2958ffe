"""The input boundary's rules, one by one (fast tier): the strict readers, the closed template path, a poisoned
calibration folder and its repair, fit's refusals, and messages that name the real problem."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from piper_plan import fileio
from piper_plan.cli.main import cli
from piper_plan.errors import PiperError
from piper_plan.fileio import MAX_DEPTH, parse_json, parse_yaml

from cases import CORPUS, ESTIMATE, GOOD_METRICS, ROOT, base_plan_text, patched_plan_text, piper_home
from make_corpus import NCCL_HEADER, nccl_line


def run(*args, env=None):
    return CliRunner(env=env).invoke(cli, [str(a) for a in args])


def one_error(result, *needles) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- the strict readers ---------------------------------------------------------------------------------
def loaders_with_libyaml():
    """(libyaml loader, Python loader); skipped where this PyYAML lacks libyaml, except under CI=true, whose test
    install takes PyYAML's PyPI wheel (built with libyaml): there it is a failure."""
    c_loader, python_loader = fileio._strict_loader_classes()
    if c_loader is None:
        assert os.environ.get("CI") != "true", "PyYAML without libyaml in the test install"
        pytest.skip("this PyYAML was built without libyaml")
    return c_loader, python_loader


@pytest.fixture(params=["libyaml", "python"])
def yaml_reader(request, monkeypatch):
    """parse_yaml as it runs with libyaml's parser (where PyYAML has it: the wheels do) and with PyYAML's own."""
    if request.param == "libyaml":
        loaders_with_libyaml()
    else:
        python_loader = fileio._strict_loader_classes()[1]
        monkeypatch.setattr(fileio, "_strict_loader_classes", lambda: (None, python_loader))
    return request.param


@pytest.mark.parametrize("text, needle", [
    ("a: 1\nb: 2\na: 3\n", "line 3: duplicate key 'a' (first at line 1)"),
    ("a: &x [1]\nb: *x\n", "line 2: YAML aliases"),
    ("a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH}"),
    ("a: " + "9" * 25, "an integer of 25 digits"),
    ("a: .inf\n", ".inf is not a finite number"),
    ("a: !!python/name:os.system x\n", "YAML tag"),
    ("2: x\n", "mapping key 2 is not a string"),
    ("num_layers: 010\n", "010 is a YAML 1.1 integer spelling"),           # PyYAML alone: 8 (octal)
    ("a: 0x200\n", "0x200 is a YAML 1.1 integer spelling"),
    ("a: 5_12\n", "5_12 is a YAML 1.1 integer spelling"),                  # 512
    ("a: 8:32\n", "8:32 is a YAML 1.1 integer spelling"),                  # base 60: 512
    ("a: 1_0.5\n", "1_0.5 is a YAML 1.1 number spelling"),
    ("gated: yes\n", "yes is a YAML 1.1 boolean spelling; write true or false"),
    ("gated: off\n", "off is a YAML 1.1 boolean spelling"),
])
def test_yaml_refusals(yaml_reader, text, needle):
    with pytest.raises(PiperError) as info:
        parse_yaml(text, "f.yaml")
    assert needle in str(info.value) and str(info.value).startswith("f.yaml: ")


@pytest.mark.parametrize("text, needle", [
    ("[" * 100_000, f"line 1: nested deeper than {MAX_DEPTH} levels"),   # libyaml: its scanner's limit (1,000)
    ("a: \x00\n", "unacceptable character #x0000"),
    ("a: \ud800\n", "unacceptable character #xd800"),  # not UTF-8 encodable: libyaml cannot take it, PyYAML reads it
    ("a: [1, 2\n", "malformed YAML at line 2, column 1"),
])
def test_yaml_hostile_text_is_one_error(yaml_reader, text, needle):
    with pytest.raises(PiperError) as info:
        parse_yaml(text, "f.yaml")
    assert needle in str(info.value) and len(str(info.value).splitlines()) == 1


def test_both_yaml_readers_read_every_shipped_file_alike(monkeypatch):
    """Every YAML document piper ships (catalog, validation datasets, the fuzz corpus) reads to the same data with
    libyaml's parser as with PyYAML's, or is refused by both (the two word syntax errors differently; piper's own
    refusals read the same: test_yaml_refusals)."""
    c_loader, python_loader = loaders_with_libyaml()
    paths = sorted(p for folder in ("models", "platforms", "validation", "tests/fuzz/corpus")
                   for p in (ROOT / folder).rglob("*.yaml"))
    assert len(paths) > 40
    read = {}
    for loaders in ((c_loader, python_loader), (None, python_loader)):
        monkeypatch.setattr(fileio, "_strict_loader_classes", lambda loaders=loaders: loaders)
        for path in paths:
            try:
                read.setdefault(path, []).append(parse_yaml(path.read_text(errors="replace"), path.name))
            except PiperError as exc:
                read.setdefault(path, []).append(("refused", "malformed" in str(exc)))
    assert all(c == py for c, py in read.values()), [p.name for p, (c, py) in read.items() if c != py]


def test_yaml_plain_values_stay_plain(yaml_reader):
    assert parse_yaml("a: 1e12\nb: 2026-11-30\nc: -2.5E-3\nd: 12\ne: 0\nf: -7\ng: True\nh: '010'\n", "f") == {
        "a": 1e12, "b": "2026-11-30", "c": -2.5e-3, "d": 12, "e": 0, "f": -7, "g": True, "h": "010"}


@pytest.mark.parametrize("text, needle", [
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"a": NaN}', "NaN is not a number"),
    ('{"a": -Infinity}', "-Infinity is not a number"),
    ('{"a": 1e999}', "1e999 is not a finite number"),
    ('{"a": ' + "1" * 5000 + "}", "an integer of 5,000 digits"),
    ("[" * 100_000, "nested deeper"),
    ('{"a": 1', "malformed JSON at line 1"),
])
def test_json_refusals(text, needle):
    with pytest.raises(PiperError) as info:
        parse_json(text, "f.json")
    assert needle in str(info.value)


def test_file_limits(tmp_path):
    big = tmp_path / "m.yaml"
    with open(big, "wb") as f:
        f.truncate(9 * 2**20)
    one_error(run("model", "show", big), "bytes; the limit is")
    bad = tmp_path / "b.yaml"
    bad.write_bytes(b"name: a\nsource: caf\xe9\n")
    one_error(run("model", "show", bad), "line 2: not a UTF-8 text file")


# ---- limits checked before anything is sized by them; messages name the real problem ---------------------
@pytest.mark.parametrize("name, needles", [
    ("num_layers-1e7", ["num_layers", "less than or equal to 10000"]),
    ("num_layers-1e9", ["num_layers", "10000"]),
    ("num_layers-true", ["num_layers: a boolean is not a number"]),
    ("hidden_size-true", ["hidden_size: a boolean is not a number"]),
    ("moe-explicit-100", ["moe.layers.explicit has indices [100] outside 0..3"]),
    ("duplicate-key", []),
])
def test_model_messages(name, needles):
    path = CORPUS / "models" / f"{name}.yaml"
    if not path.exists():
        path = CORPUS / "models" / f"model-{name}.yaml"
    line = one_error(run("model", "show", path), *needles)
    assert "dense_ffn" not in line


@pytest.mark.parametrize("name, needle", [
    ("no-links", "node.link_classes"), ("no-scopes", "network.scopes"),
    ("num_nics-zero", "needs NICs"), ("nic_bandwidth-zero", "needs NICs"), ("peak-tiny", "peak_flops.fp32"),
    ("devices-1e9", "devices_per_node"), ("nodes_per_group-1e15", "nodes_per_group"),
])
def test_platform_messages(name, needle):
    one_error(run("platform", "show", CORPUS / "platforms" / f"{name}.yaml"), needle)


@pytest.mark.parametrize("name, needle", [
    ("model_type-list", "model_type"), ("tie-string-false", "tie_word_embeddings: must be true or false"),
    ("layers-true", "num_hidden_layers"),
])
def test_hf_messages(name, needle):
    one_error(run("model", "import", CORPUS / "hf" / f"{name}.json"), needle)


# ---- templates: a received plan.json names a template, never a path ----------------------------------------
@pytest.mark.parametrize("template", [str(CORPUS / "templates" / "evil.sbatch"), "../../tests/fuzz/corpus/templates/evil.sbatch",
                                      "sub/local-cpu.sbatch"])
def test_plan_cannot_point_launch_at_a_template_file(tmp_path, template):
    (tmp_path / "plan.json").write_text(patched_plan_text({"platform.launch.template": template}))
    for extra in ([], ["--dry-run"]):
        result = run("launch", "--plan", tmp_path / "plan.json", "--out", tmp_path / "job", *extra)
        one_error(result, "launch.template", "not a template name")
        assert "piper-fuzz-pwned" not in result.stdout
    assert not (tmp_path / "job").exists()


def test_template_beside_a_platform_file_given_on_the_command_line(tmp_path):
    folder = tmp_path / "site"
    folder.mkdir()
    shutil.copy(ROOT / "platforms" / "templates" / "local-cpu.sbatch", folder / "site.sbatch")
    with open(folder / "site.sbatch", "a") as f:
        f.write("# site template\n")
    platform = (ROOT / "platforms" / "local-cpu.yaml").read_text().replace("template: local-cpu.sbatch",
                                                                           "template: site.sbatch")
    (folder / "site.yaml").write_text(platform)
    result = run("launch", "--model", "tiny-moe", "--platform", folder / "site.yaml", "--nodes", "1", "--seq", "128",
                 "--global-batch", "8", "--out", tmp_path / "job", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "# site template" in result.stdout
    # the same template name in a received plan.json alone is not found (no folder of the plan's choosing)
    saved = json.loads(base_plan_text())
    saved["platform"]["launch"]["template"] = "site.sbatch"
    (tmp_path / "plan.json").write_text(json.dumps(saved))
    one_error(run("launch", "--plan", tmp_path / "plan.json", "--out", tmp_path / "job2"), "no such file")


@pytest.mark.parametrize("time", ["00:00:00", "999-99:00:00", "366-00:00:00", "1-24:00:00"])
def test_wall_time_limits(tmp_path, time):
    (tmp_path / "plan.json").write_text(base_plan_text())
    one_error(run("launch", "--plan", tmp_path / "plan.json", "--out", tmp_path / "job", "--time", time), "time=")


@pytest.mark.parametrize("steps, needle", [(10**15, "runtime.steps: Input should be less than or equal to 1000000000"),
                                           (10**9, "365 days")])
def test_absurd_steps_do_not_render_a_time(tmp_path, steps, needle):
    (tmp_path / "plan.json").write_text(patched_plan_text({"runtime.steps": steps}))
    one_error(run("launch", "--plan", tmp_path / "plan.json", "--out", tmp_path / "job", "--dry-run"), needle)


# ---- a poisoned calibration folder: reported with file and row, repaired by re-importing --------------------
def test_poisoned_collectives_are_reported_and_repaired_by_reimport(tmp_path):
    cal = piper_home(tmp_path)
    env = {"PIPER_HOME": str(tmp_path / "home")}
    nan_log = tmp_path / "nan.txt"
    nan_log.write_text(NCCL_HEADER + nccl_line(time="nan"))
    before = (cal / "collectives.csv").read_text()
    args = ["--op", "all_to_all", "--nodes", "1", "--ranks-per-node", "2", "--scope", "node", "--platform", "local-cpu"]
    one_error(run("calibrate", "import-nccl-tests", nan_log, *args, env=env), "line 4", "time 'nan'")
    assert (cal / "collectives.csv").read_text() == before                     # nothing written
    # the NaN row an older piper wrote: every reader names the file and the line
    lines = before.splitlines()
    (cal / "collectives.csv").write_text(before + "all_to_all,node,1,2,1048576,nan,nan,nan,imported: old\n")
    where = f"collectives.csv: line {len(lines) + 1}"
    one_error(run(*ESTIMATE, env=env), where, "not a finite number")
    one_error(run("calibrate", "show", "--platform", cal), where)
    good = tmp_path / "good.txt"
    good.write_text(NCCL_HEADER + nccl_line())
    assert run("calibrate", "import-nccl-tests", good, *args, env=env).exit_code == 0
    assert "nan" not in (cal / "collectives.csv").read_text()
    assert run(*ESTIMATE, env=env).exit_code == 0


def test_malformed_metadata_is_reported(tmp_path):
    cal = tmp_path / "cal"
    shutil.copytree(ROOT / "calibration" / "local-cpu", cal)
    (cal / "metadata.json").write_text("{oops")
    one_error(run("calibrate", "show", "--platform", cal), "metadata.json", "malformed JSON")


def test_load_fit_is_strict(tmp_path):
    from piper_plan.calibration.fit import load_fit
    from piper_plan.catalog import load_platform

    header = "parameter,value,before,mape_before_pct,mape_after_pct,source\n"
    for row, needle in (("a2a_overlap,nan,0,1,1,x", "not a finite number"), ("warp,0.5,0,1,1,x", "'warp' is not one of"),
                        ("a2a_overlap,3,0,1,1,x", "outside its range")):
        (tmp_path / "fit.csv").write_text(header + row + "\n")
        with pytest.raises(PiperError, match=needle):
            load_fit(load_platform("local-cpu"), tmp_path / "fit.csv")


# ---- nccl-tests import ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, needle", [
    ("wrong-inplace", "wrong results"), ("size-negative", "line 6: size '-1024'"), ("size-fraction", "line 6: size '1024.5'"),
    ("header-no-time", "line 1: the table header has no time column"), ("time-inf", "time 'inf'"),
])
def test_nccl_import_refusals(tmp_path, name, needle):
    one_error(run("calibrate", "import-nccl-tests", CORPUS / "nccl" / f"{name}.txt", "--op", "all_to_all", "--nodes", "1",
                  "--ranks-per-node", "2", "--scope", "node", "--platform", "frontier", "--out", tmp_path / "cal"), needle)
    assert not (tmp_path / "cal" / "collectives.csv").exists()


def test_nccl_import_option_checks(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text(NCCL_HEADER + nccl_line())
    base = ["calibrate", "import-nccl-tests", good, "--op", "all_to_all", "--ranks-per-node", "2", "--out", tmp_path / "c"]
    one_error(run(*base, "--nodes", "2", "--scope", "node", "--platform", "frontier"), "scope node is one node")
    one_error(run(*base, "--nodes", "1", "--scope", "node", "--platform", "no-such"), "unknown platform 'no-such'")
    one_error(run("calibrate", "import-nccl-tests", tmp_path, "--op", "all_to_all", "--ranks-per-node", "2", "--nodes",
                  "1", "--scope", "node", "--platform", "frontier"), "is a directory")
    one_error(run(*base, "--nodes", "1", "--scope", "node"), "--platform")     # never a platform the user did not name


# ---- calibrate fit ------------------------------------------------------------------------------------------
def _run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "plan.json").write_text(base_plan_text())
    (d / "metrics.jsonl").write_text(GOOD_METRICS)
    return d


def test_fit_counts_a_run_named_twice_once(tmp_path):
    """Before: r, ./r and /abs/r were 3 runs, 3 parameters fitted to one measurement ("0.0% after")."""
    d = _run_dir(tmp_path)
    one_error(run("calibrate", "fit", d, f"{d}/.", d.resolve(), "--dry-run", env={"PIPER_HOME": str(ROOT)}),
              "is the run", "again; give each run once")


def test_fit_refuses_runs_of_two_platforms(tmp_path):
    """Before: every run was priced with the first run's platform and calibration, and the fit written there."""
    first = _run_dir(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    data = json.loads(base_plan_text())
    data["platform"]["efficiency"]["gemm"] = 0.5               # the same name, other figures
    (other / "plan.json").write_text(json.dumps(data))
    (other / "metrics.jsonl").write_text(GOOD_METRICS)
    one_error(run("calibrate", "fit", first, other, "--dry-run", env={"PIPER_HOME": str(ROOT)}),
              f"{other}: ran on another local-cpu (other figures), but {first} ran on local-cpu; fit runs of one platform")


@pytest.mark.parametrize("expert_tokens, needle", [
    ({"0": [1] * 8, "7": [1] * 8}, "layer 7 with 8 experts"),         # tiny-moe's MoE layers are 0..3
    ({"0": [1] * 64}, "layer 0 with 64 experts"),                     # it routes 8
    ([[1] * 8] * 5, "layer 4 with 8 experts"),                        # 5 layers in list form
    ({"x": "y"}, "layer x with ? experts"),                            # before: compared as tiny-moe's
])
def test_compare_and_fit_refuse_metrics_of_another_model(tmp_path, expert_tokens, needle):
    """Before: a dense or other-sized plan.json beside a tiny-moe run's metrics (same tokens and layout) compared
    and fitted as if they were its own run."""
    d = _run_dir(tmp_path)
    lines = [json.loads(line) for line in GOOD_METRICS.splitlines()]
    (d / "metrics.jsonl").write_text("".join(json.dumps({**r, "expert_tokens": expert_tokens}) + "\n" for r in lines))
    tail = "the metrics are of another model; compare a run directory with the plan.json it ran"
    one_error(run("compare", d), needle, "model tiny-moe routes 8 experts in layers [0, 1, 2, 3]", tail)
    one_error(run("calibrate", "fit", d, "--dry-run", env={"PIPER_HOME": str(ROOT)}), needle, tail)
    good = {str(layer): [1] * 8 for layer in range(4)}
    (d / "metrics.jsonl").write_text("".join(json.dumps({**r, "expert_tokens": good}) + "\n" for r in lines))
    assert run("compare", d).exit_code == 0


def test_fit_refuses_unknown_and_underdetermined_parameters(tmp_path):
    d = _run_dir(tmp_path)
    env = {"PIPER_HOME": str(ROOT)}
    one_error(run("calibrate", "fit", d, "--dry-run", "--param", "bogus", env=env), "'bogus' is not a fittable parameter")
    one_error(run("calibrate", "fit", d, "--dry-run", "--param", "a2a_overlap", "--param", "a2a_overlap", env=env),
              "--param: 'a2a_overlap' given more than once")          # was: "underdetermined" by 2 parameters
    one_error(run("calibrate", "fit", d, "--dry-run", "--param", "a2a_overlap", "--param", "dp_overlap", "--param",
                  "overhead.scale", env=env), "from 1 run(s): underdetermined by")


def test_odd_keys_stay_on_one_line(tmp_path):
    model = json.loads(json.dumps(__import__("yaml").safe_load((ROOT / "models" / "tiny-moe.yaml").read_text())))
    model["attention"] = {"\n#x": 1}
    (tmp_path / "m.json").write_text(json.dumps(model))
    one_error(run("model", "show", tmp_path / "m.json"), "attention.'\\n#x': unknown field")
