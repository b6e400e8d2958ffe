"""The catalog commands through click's CliRunner: JSON on stdout, one-line user errors with exit code 2."""

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.cli.models import format_count, layer_ranges

FIXTURES = Path(__file__).resolve().parents[1] / "specs" / "fixtures"


def run(*args):
    return CliRunner().invoke(cli, list(args))


def run_json(*args):
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_models_json_lists_the_catalog_with_exact_counts():
    rows = {r["name"]: r for r in run_json("models")}
    assert rows["mixtral-8x7b"]["total_params"] == 46_702_792_704
    assert rows["mixtral-8x7b"]["active_params"] == 12_879_925_248
    assert rows["deepseek-v3"]["num_experts"] == 256 and rows["deepseek-v3"]["top_k"] == 8
    assert rows["gpt-175b"]["num_experts"] == 0
    assert len(rows) >= 26


def test_human_results_go_to_stdout_only():
    result = run("models")
    assert result.exit_code == 0 and result.stderr == ""
    assert "mixtral-8x7b" in result.stdout
    for args in (("model", "show", "tiny-mla"), ("platforms",), ("platform", "show", "frontier")):
        shown = run(*args)
        assert shown.exit_code == 0 and shown.stderr == "" and shown.stdout


def test_model_show_json_breaks_counts_down():
    s = run_json("model", "show", "deepseek-v3")
    parts = s["params_by_component"]
    assert sum(v for k, v in parts.items() if k != "routed_experts_active") == s["total_params"] == 671_026_404_352
    assert s["active_params"] - s["active_params_excluding_embedding"] == parts["embedding"] == 129_280 * 7168
    assert s["dense_layers"] == [0, 1, 2] and s["moe_layers"] == list(range(3, 61))


def test_model_show_accepts_a_file(tmp_path):
    path = tmp_path / "mine.yaml"
    data = yaml.safe_load(Path(__file__).resolve().parents[2].joinpath("models/tiny-moe.yaml").read_text())
    path.write_text(yaml.safe_dump({**data, "name": "mine"}))
    s = run_json("model", "show", str(path))
    assert s["name"] == "mine" and s["total_params"] == 903_744


def test_platforms_json_and_show():
    rows = {r["name"]: r for r in run_json("platforms")}
    assert {"frontier", "dgx-a100", "dgx-h100"} <= set(rows)
    assert rows["dgx-a100"]["peak_bf16_flops"] == 312e12 and rows["dgx-h100"]["peak_bf16_flops"] == 989e12
    s = run_json("platform", "show", "dgx-h100")
    assert s["devices_per_node"] == 8 and s["node_injection_GBps"] == 400
    assert s["spec"]["launch"]["template"] == "dgx-h100.sbatch"


def test_platform_show_prints_the_rates_the_cost_model_takes():
    """The efficiency block was in --json only: the GEMM rate per precision, each fp8 recipe's measured time, the
    host time per GEMM call."""
    def efficiency(name: str) -> str:          # the block's first line, unwrapped (the console wraps at its width)
        text = " ".join(run("platform", "show", name).stdout.split())
        return text[text.index("efficiency: "):text.index(" source: ", text.index("efficiency: "))]

    eff = efficiency("dgx-h100")
    assert "gemm 0.8, fp8 0.709" in eff and "fp8 recipe time tensorwise x1.2086" in eff
    assert re.search(r"host per GEMM call \d+\.\d us$", eff), eff
    eff = efficiency("frontier")
    assert "fp8 recipe" not in eff and eff.endswith("host per GEMM call not priced")


def test_import_writes_a_spec_that_loads_back(tmp_path):
    out = tmp_path / "qwen.yaml"
    s = run_json("model", "import", str(FIXTURES / "qwen3-30b-a3b.json"), "-o", str(out), "--name", "qwen3-30b")
    assert s["name"] == "qwen3-30b" and s["total_params"] == 30_532_122_624
    loaded = run_json("model", "show", str(out))
    assert (loaded["total_params"], loaded["active_params"]) == (30_532_122_624, 3_353_032_704)
    again = run("model", "import", str(FIXTURES / "qwen3-30b-a3b.json"), "-o", str(out))
    assert again.exit_code == 2 and "--force" in again.stderr


def test_import_writes_json_to_a_json_file_and_never_over_its_input(tmp_path):
    """The loaders read a spec by its suffix: -o x.json gets JSON that `model show` reads back; the config itself is
    never the output, --force or not."""
    out = tmp_path / "qwen.json"
    assert run("model", "import", str(FIXTURES / "qwen3-30b-a3b.json"), "-o", str(out)).exit_code == 0
    assert json.loads(out.read_text())["hidden_size"] == 2048
    assert run_json("model", "show", str(out))["total_params"] == 30_532_122_624
    config = tmp_path / "config.json"
    config.write_bytes((FIXTURES / "qwen3-30b-a3b.json").read_bytes())
    before = config.read_bytes()
    result = run("model", "import", str(config), "-o", str(config), "--force")
    assert_user_error(result, str(config), "is also this command's CONFIG input")
    assert config.read_bytes() == before


def test_import_without_output_prints_yaml():
    result = run("model", "import", str(FIXTURES / "mixtral-8x7b.json"))
    assert result.exit_code == 0
    assert yaml.safe_load(result.stdout)["hidden_size"] == 4096


def piper_under(env: dict, *args, cwd: Path):
    """piper in a process of its own under this environment plus ``env`` (no locale or stream encoding inherited):
    for what the streams' encoding or the locale changes. Arguments and output are bytes."""
    import os
    import subprocess
    import sys

    inherited = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "PYTHONUTF8", "LC_ALL", "LANG")}
    return subprocess.run([sys.executable, "-m", "piper_plan.cli.main", *map(os.fsencode, args)],
                          env={**inherited, **env}, cwd=cwd, capture_output=True, timeout=60)


def test_a_character_the_output_stream_cannot_encode_is_escaped(tmp_path):
    """`model show` of a model named 'qwén' on an ASCII stdout ended in a UnicodeEncodeError traceback, exit 1."""
    assert run("model", "import", str(FIXTURES / "qwen3-30b-a3b.json"), "--name", "qwén", "-o",
               str(tmp_path / "q.yaml")).exit_code == 0
    for env in ({"PYTHONIOENCODING": "ascii", "COLUMNS": "40"}, {"LC_ALL": "C", "PYTHONUTF8": "0"}):
        done = piper_under(env, "model", "show", "q.yaml", cwd=tmp_path)
        assert (done.returncode, done.stderr) == (0, b""), (env, done.stderr.decode())
        assert done.stdout.startswith(b"qw\\xe9n: 30.5B total") and b"311,164,928" in done.stdout, done.stdout
        assert done.stdout.isascii() and b"\\u2" not in done.stdout, done.stdout      # boxes and rules in ASCII


def test_import_blames_a_bad_name_on_the_name_option(tmp_path):
    """Under LC_ALL=C (PYTHONUTF8=0) --name qwén arrives as lone surrogates: the error blamed the config file
    ('Invalid JSON: lone leading surrogate') and dumped the whole spec. A name on two lines blamed the file too."""
    done = piper_under({"LC_ALL": "C", "PYTHONUTF8": "0"}, "model", "import", FIXTURES / "qwen3-30b-a3b.json",
                       "--name", b"qw\xc3\xa9n", "-o", "q.yaml", cwd=tmp_path)
    lines = done.stderr.decode("ascii").splitlines()
    assert done.returncode == 2 and len(lines) == 1 and list(tmp_path.iterdir()) == [], done.stderr
    assert lines[0].startswith("error: --name: ") and "UTF-8 locale" in lines[0] and ".json" not in lines[0]
    two_lines = run("model", "import", str(FIXTURES / "qwen3-30b-a3b.json"), "--name", "a\nb")
    assert_user_error(two_lines, "error: --name: a name is one line")
    assert ".json" not in two_lines.stderr


def test_formatting_is_decimal():
    assert format_count(46_702_792_704) == "46.7B"
    assert format_count(1_026_408_209_408) == "1.03T"
    assert format_count(174_615_846_912) == "174.6B"
    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


# ---- bad input: one line naming file and field, exit code 2, no traceback -----------------------------

def _model_yaml(tmp_path, **changes):
    data = yaml.safe_load(Path(__file__).resolve().parents[2].joinpath("models/tiny-moe.yaml").read_text())
    for dotted, value in changes.items():
        node, keys = data, dotted.split("__")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def assert_user_error(result, *needles):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("changes, needles", [
    ({"colour": "red"}, ["colour: unknown field"]),
    ({"hidden_size": 0}, ["hidden_size:", "greater than or equal to 1", "(got 0)"]),
    ({"num_layers": -3}, ["num_layers:", "greater than or equal to 1", "(got -3)"]),
    ({"moe__expert__intermediate_size": 0}, ["moe.expert.intermediate_size:", "greater than or equal to 1"]),
    ({"moe__top_k": 9}, ["moe:", "top_k=9 must be <= num_experts=8"]),
])
def test_bad_model_yaml(tmp_path, changes, needles):
    path = _model_yaml(tmp_path, **changes)
    assert_user_error(run("model", "show", str(path)), str(path), *needles)


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere.yaml"
    assert_user_error(run("model", "show", str(path)), str(path), "file not found")
    assert_user_error(run("model", "import", str(tmp_path / "config.json")), "config.json", "file not found")


def test_unknown_catalog_name_suggests():
    assert_user_error(run("model", "show", "mixtral-8x7"), "unknown model 'mixtral-8x7'", "mixtral-8x7b")
    assert_user_error(run("platform", "show", "frontiers"), "unknown platform", "frontier")


def test_malformed_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nattention: {num_heads: 4\n")
    assert_user_error(run("model", "show", str(path)), str(path), "malformed YAML at line")


def test_malformed_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "mixtral", "hidden_size": 4096,,}')
    assert_user_error(run("model", "import", str(path)), str(path), "malformed JSON at line 1")


def test_unsupported_model_type():
    assert_user_error(run("model", "import", str(FIXTURES / "grok-1.json")), "grok-1.json", "model_type",
                      "unsupported model_type 'grok-1'", "mixtral", "qwen3_moe")


def test_import_bad_field_value(tmp_path):
    cfg = json.loads((FIXTURES / "mixtral-8x7b.json").read_text())
    cfg["num_experts_per_tok"] = 9
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert_user_error(run("model", "import", str(path)), str(path), "top_k=9 must be <= num_experts=8")


def test_bad_platform_yaml(tmp_path):
    data = yaml.safe_load(Path(__file__).resolve().parents[2].joinpath("platforms/dgx-a100.yaml").read_text())
    data["device"]["memory_bytes"] = -1
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    assert_user_error(run("platform", "show", str(path)), str(path), "device.memory_bytes:", "greater than or equal to 1")
