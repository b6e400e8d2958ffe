"""`piper migrate simulate` through click's CliRunner on the real command group."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli


def _run(*args: str):
    return CliRunner().invoke(cli, ["migrate", "simulate", *args])


def _json(*args: str) -> dict:
    result = _run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_per_algorithm():
    out = _json("--experts", "64", "--ep", "8", "--layers", "4", "--skew", "zipf:0.8", "--seed", "3")
    assert (out["experts"], out["ep"], out["layers"]) == (64, 8, 4)
    assert set(out["algorithms"]) == {"hill_climb", "greedy"}         # 64 into 8: too many partitions for optimal
    for name, r in out["algorithms"].items():
        assert r["after"]["max_over_mean"] <= r["before"]["max_over_mean"]
        assert out["bound"]["max_over_mean"] <= r["after"]["max_over_mean"] + 1e-12
        assert r["bytes_moved"] is None and r["time_s"] is None        # no model/platform: not priced
        assert len(r["before"]["per_layer"]) == 4
    hill = out["algorithms"]["hill_climb"]
    assert 0 < hill["num_swaps"] <= 4 * 16
    assert hill["before"]["max_over_mean"] > 1.1


def test_seed_changes_synthetic_loads():
    a = _json("--experts", "12", "--ep", "4", "--skew", "dirichlet:0.3", "--seed", "1")
    b = _json("--experts", "12", "--ep", "4", "--skew", "dirichlet:0.3", "--seed", "2")
    assert a["algorithms"]["greedy"]["before"] != b["algorithms"]["greedy"]["before"]
    assert a == _json("--experts", "12", "--ep", "4", "--skew", "dirichlet:0.3", "--seed", "1")
    assert "optimal" in a["algorithms"]              # 12 into 4: 15400 partitions <= 20000, exact optimum added
    opt = a["algorithms"]["optimal"]["after"]["max_over_mean"]
    assert all(opt <= r["after"]["max_over_mean"] + 1e-12 for r in a["algorithms"].values())


def test_priced_with_model_and_platform():
    out = _json("--model", "mixtral-8x7b", "--platform", "frontier", "--ep", "2", "--skew", "zipf:1.2")
    p = out["pricing"]
    # Mixtral expert: 3 x 4096 x 14336 params x (2 weights + 4 master + 8 Adam) bytes; GCD pair link 200 GB/s
    assert p["bytes_per_expert"] == 3 * 4096 * 14336 * 14
    assert p["bandwidth_GBps"] == 200.0 and p["scope"] == "node"
    for r in out["algorithms"].values():
        assert r["bytes_moved"] == r["experts_moved"] * p["bytes_per_expert"]
        assert r["time_s"] == pytest.approx(r["max_experts_sent_per_rank"] * p["bytes_per_expert"] / 200e9)
    assert out["algorithms"]["optimal"]["after"]["max_over_mean"] <= out["algorithms"]["hill_climb"]["after"]["max_over_mean"]


def test_with_grads_is_papers_16_bytes():
    out = _json("--model", "mixtral-8x7b", "--platform", "frontier", "--ep", "4", "--with-grads")
    assert out["pricing"]["bytes_per_expert"] == 48 * 4096 * 14336      # piper-paper.md: 48 d d_ffn
    assert out["pricing"]["bandwidth_GBps"] == 50.0                       # cross-package link


def test_measured_loads_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"schema_version": 1, "step": s, "expert_tokens": [[40, 30, 2, 1], [1, 2, 3, 4]]} for s in (1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _json("--ep", "2", "--skew", str(path))
    assert (out["experts"], out["layers"]) == (4, 2)
    hill = out["algorithms"]["hill_climb"]
    # layer 0 summed: [80, 60, 4, 2] -> ranks [140, 6] -> swap 80 <-> 4 gives [64, 82]; layer 1: [3, 7] = 1.4 > 1.1
    assert hill["before"]["per_layer"] == pytest.approx([140 / 73, 7 / 5])
    assert hill["after"]["per_layer"][0] == pytest.approx(82 / 73)


def test_human_output_goes_to_stdout():
    result = _run("--experts", "8", "--ep", "2")
    assert result.exit_code == 0
    assert result.stderr == ""
    assert "hill_climb" in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--experts", "10", "--ep", "3"], "--ep 3 must divide"),
    (["--experts", "8", "--ep", "2", "--skew", "zipf:abc"], "--skew"),
    (["--experts", "8", "--ep", "2", "--skew", "/nonexistent/metrics.jsonl"], "file not found"),
    (["--ep", "2"], "--experts is required"),
    (["--experts", "8", "--ep", "2", "--model", "mixtral-8x7b"], "go together"),
    (["--experts", "16", "--ep", "2", "--model", "mixtral-8x7b", "--platform", "frontier"], "contradicts"),
])
def test_user_errors_exit_2_one_line(args, fragment):
    result = _run(*args)
    assert result.exit_code == 2
    assert fragment in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_threshold_gates_every_algorithm():
    args = ("--experts", "32", "--ep", "4", "--layers", "3", "--skew", "dirichlet:0.5")
    low, high = _json(*args, "--threshold", "1.0"), _json(*args, "--threshold", "50")
    assert low["algorithms"]["hill_climb"]["layers_triggered"] == 3
    for r in high["algorithms"].values():
        assert r["layers_triggered"] == 0 and r["num_swaps"] == 0 and r["experts_moved"] == 0
        assert r["after"]["max_over_mean"] == r["before"]["max_over_mean"]


def test_group_across_nodes_priced_by_network_scope(tmp_path):
    model = tmp_path / "moe32.yaml"
    model.write_text("name: moe32\nsource: test\nvocab_size: null\nhidden_size: 64\nnum_layers: 2\n"
                     "attention: {kind: mha, num_heads: 4}\n"
                     "moe: {num_experts: 32, top_k: 2, expert: {intermediate_size: 128}}\n")
    args = ("--model", str(model), "--platform", "frontier", "--ep", "16")
    compact, spread = _json(*args), _json(*args, "--placement", "spread")
    # frontier.yaml: 16 GCDs = 2 nodes on one switch (12.5 GB/s per GCD); spread: 2 groups -> system 7.14
    assert (compact["pricing"]["scope"], compact["pricing"]["bandwidth_GBps"]) == ("switch", 12.5)
    assert (spread["pricing"]["scope"], spread["pricing"]["bandwidth_GBps"]) == ("system", 7.14)
    assert compact["pricing"]["bytes_per_expert"] == 3 * 64 * 128 * 14      # gated expert x 14 B/param
    hill_c, hill_s = compact["algorithms"]["hill_climb"], spread["algorithms"]["hill_climb"]
    assert hill_s["time_s"] == pytest.approx(hill_c["time_s"] * 12.5 / 7.14)


def _metrics(tmp_path, expert_tokens) -> str:
    """A metrics.jsonl whose line 2 carries ``expert_tokens`` (line 1 is a valid step)."""
    path = tmp_path / "metrics.jsonl"
    good = {"schema_version": 1, "step": 1, "expert_tokens": [[10, 20, 30, 40], [1, 2, 3, 4]]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"schema_version": 1, "step": 2,
                                                          "expert_tokens": expert_tokens}) + "\n")
    return str(path)


@pytest.mark.parametrize("expert_tokens, fragment", [
    ([[True, False, True, True], [1, 2, 3, 4]], "expert_tokens[0][0]: true is not a token count"),
    ([[10, 20, 30, 40], [1, "2", 3, 4]], "expert_tokens[1][1]: \"2\" is not a token count"),
    ([["1e3", 20, 30, 40], [1, 2, 3, 4]], "expert_tokens[0][0]: \"1e3\" is not a token count"),
    ([[10, 20, 30, 40], [1, 2, 3, 4.5]], "expert_tokens[1][3]: 4.5 is not a token count"),
    ([[10, 20, 30, 40], [1, 2, 3, -4]], "expert_tokens[1][3]: -4 is not a token count"),
    ([[10, 20, 30, 40], [1, 2, 3, None]], "expert_tokens[1][3]: null is not a token count"),
    ([[10, 20, 30, 40], [1, 2, 3, 2**53 + 1]], "expert_tokens[1][3]: 9007199254740993 is not a token count"),
    ([[10, 20, 30, 40], [1, 2, 3]], "expert_tokens[1]: 3 experts, layer 0 has 4"),
    ([[10, 20, 30, 40], 5], "expert_tokens[1]: 5 is not a list of token counts"),
    ({"0": [10, 20, 30, 40], "00": [1, 2, 3, 4]}, "expert_tokens: layer key \"00\" is not a layer index"),
    ({"3": [10, 20, 30, 40], "03": [1, 2, 3, 4]}, "expert_tokens: layer key \"03\" is not a layer index"),
    ({"-1": [10, 20, 30, 40], "0": [1, 2, 3, 4]}, "expert_tokens: layer key \"-1\" is not a layer index"),
    ({"0": [10, 20, 30, 40], " 1": [1, 2, 3, 4]}, "expert_tokens: layer key \" 1\" is not a layer index"),
    ({}, "expert_tokens: {} is not"),
])
def test_measured_loads_bad_counts_one_line(tmp_path, expert_tokens, fragment):
    path = _metrics(tmp_path, expert_tokens)
    result = _run("--ep", "2", "--skew", path)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {path}: line 2: field {fragment}")
    assert "allowed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_measured_loads_layer_keys_and_whole_floats(tmp_path):
    tokens = {"1": [1.0, 2, 3, 4e0], "0": [10, 20, 30, 40]}       # keys in any order; 4e0 is a whole number
    out = _json("--ep", "2", "--skew", _metrics(tmp_path, tokens))
    assert out["algorithms"]["hill_climb"]["before"]["per_layer"] == pytest.approx([140 / 100, 14 / 10])


def test_measured_loads_keyed_by_the_runtimes_global_layer_indices(tmp_path):
    """piper's runtime keys expert_tokens by each MoE layer's global index (runtime/train.py merge_reports): 3, 4, ...
    for DeepSeek-V3, 1, 3, 5, ... for Llama 4 Maverick; a file of them is read in layer order."""
    tokens = {"12": [5, 5, 5, 10], "3": [10, 20, 30, 40]}              # layer 3 first, though "12" < "3" as text
    out = _json("--ep", "2", "--skew", _metrics(tmp_path, tokens))
    # summed with line 1 ([[10, 20, 30, 40], [1, 2, 3, 4]]): layer 0 as line 1 twice, layer 1 [6, 7, 8, 14]
    assert out["algorithms"]["hill_climb"]["before"]["per_layer"] == pytest.approx([140 / 100, 22 / 17.5])


@pytest.mark.parametrize("skew", ["zipf:1_2", "zipf:\uff11.2", "zipf: 1.2", "zipf:1.2 ", "dirichlet:0_3",
                                  "dirichlet:\u0663", "zipf:1.2\n", "zipf:infinity", "zipf:nan", "zipf:0x10"])
def test_skew_number_is_plain_ascii_decimal(skew):
    result = _run("--experts", "8", "--ep", "2", "--skew", skew)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --skew ") and "not a number" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("skew", ["zipf:1e-3", "zipf:.5", "zipf:2.", "zipf:0", "dirichlet:3", "dirichlet:1E+1"])
def test_skew_plain_decimals_accepted(skew):
    assert _json("--experts", "8", "--ep", "2", "--skew", skew)["skew"].split(":")[0] == skew.split(":")[0]
