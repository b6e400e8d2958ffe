"""Megatron-Core layout strings for virtual_stage_layers (``specs.parallel.layout_decoder_counts``): the embedding,
the loss and the MTP layers in Megatron-Core's order (NVIDIA/Megatron-LM 00caa53,
pipeline_parallel_layer_layout.py ``validate_layer_layout``), else one error line."""

import json

import pytest
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.specs.parallel import layout_decoder_counts, layout_string


@pytest.mark.parametrize("layout, counts", [
    ("Et|t|t|tL", [1, 1, 1, 1]),
    ("Et|(tt|)*30mL", [1] + [2] * 30 + [0]),                 # Megatron-Bridge's DeepSeek-V3 H100 preset
    ("Et*4|(t*4|)*14tmL", [4] * 15 + [1]),                   # the recipe's pp 4 vp 4 layout
    ("Et*3|(tt|)*29,m|L", [3] + [2] * 29 + [0, 0]),          # Megatron-Core's documented example: m in its own chunk
    ("t|t|t|t", [1, 1, 1, 1]),                               # E and L at most once: absent is allowed
    ("Et|t|t|tmm||L", [1, 1, 1, 1, 0, 0])])
def test_megatron_order_is_read(layout, counts):
    assert layout_decoder_counts(layout) == counts


@pytest.mark.parametrize("chunks, mtp", [([1, 2, 0], 1), ([3, 3], 0), ([2, 1, 1, 2], 3)])
def test_layout_string_reads_back(chunks, mtp):
    assert layout_decoder_counts(layout_string(chunks, mtp)) == chunks


@pytest.mark.parametrize("layout, rule", [
    ("EEt|t|t|tL", "the embedding E at most once"),
    ("tE|t|t|tL", "the embedding E at most once, first in the first chunk"),
    ("Et|Et|t|tL", "first in the first chunk"),
    ("Et|t|t|tLL", "the loss L at most once"),
    ("Et|t|t|Lt", "last in the last chunk"),
    ("EtLt|t|t|", "last in the last chunk"),                # the loss in the first chunk
    ("Et|t|m|tL", "the MTP layers m together in one chunk after every t"),
    ("Et|t|tm|mL", "the MTP layers m together in one chunk after every t"),
    ("Emt|t|t|tL", "the MTP layers m together in one chunk after every t"),
    ("Et|t|t|tmLm", "last in the last chunk")])
def test_misplaced_layers_are_refused(layout, rule):
    with pytest.raises(ValueError) as err:
        layout_decoder_counts(layout)
    assert f"layout {layout!r}: misplaced layers; allowed: " in str(err.value) and rule in str(err.value)


@pytest.mark.parametrize("layout", ["((t|)*16)", "(t|)*-1", "E(t|)*L", "Et|(t|*3L"])
def test_a_repeat_that_cannot_be_read_is_named_as_one(layout):
    """Before: 'unknown characters ['(', ')', '*', ...]' though parentheses and * are the layout's own syntax."""
    with pytest.raises(ValueError) as err:
        layout_decoder_counts(layout)
    assert f"layout {layout!r}: a repeat piper cannot read; allowed (...)*n or x*n with a whole n >= 0" in str(err.value)


@pytest.mark.parametrize("layout", ["EEt|t|t|tLL", "tE|t|t|Lt", "EtLt|t|t|"])
def test_cli_one_error_line(layout):
    """The reproducers of the fuzz report: exit 2 and one 'error:' line naming the layout, no estimate."""
    result = CliRunner().invoke(cli, ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                      "--seq", "128", "--global-batch", "8", "--dp", "1", "--pp", "2",
                                      "--schedule", "interleaved", "--virtual-stage-layers", layout])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error:") and f"layout {layout!r}: misplaced layers" in lines[0], lines[0]


@pytest.mark.parametrize("layout, flags, needle", [
    ("Et|t|t|tmmmL", [], "places 3 MTP layer(s) (m) and the model trains 0"),     # tiny-moe has no MTP module
    ("Et|t|t|tmL", [], "places 1 MTP layer(s) (m) and the model trains 0")])
def test_a_layout_places_as_many_mtp_layers_as_the_model_trains(layout, flags, needle):
    """Megatron-Core's validate_layer_layout requires the m count to equal the MTP layers; the CLI and the
    validation rows hold layouts to it (a phantom 'mmm' was priced silently)."""
    result = CliRunner().invoke(cli, ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                      "--seq", "128", "--global-batch", "8", "--dp", "1", "--pp", "2",
                                      "--schedule", "interleaved", "--virtual-stage-layers", layout, *flags])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert f"--virtual-stage-layers: layout {layout!r} {needle}" in result.stderr
    ok = CliRunner().invoke(cli, ["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1",
                                  "--seq", "128", "--global-batch", "8", "--dp", "1", "--pp", "2",
                                  "--schedule", "interleaved", "--virtual-stage-layers", "Et|t|t|tL"])
    assert ok.exit_code == 0, ok.output


def test_the_layout_gives_the_virtual_stages_as_megatron_infers_them():
    """pp 2 and 8 chunks: 4 virtual stages without --virtual-stages (before: refused against the default 2); a
    --virtual-stages given is held to the layout."""
    args = ["estimate", "--model", "mixtral-8x7b", "--platform", "dgx-h100", "--nodes", "1", "--dp", "4", "--pp",
            "2", "--ep", "4", "--schedule", "interleaved", "--virtual-stage-layers", "E(tttt|)*7ttttL", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["parallel"]["virtual_stages"] == 4
    refused = CliRunner().invoke(cli, [*args, "--virtual-stages", "2"])
    assert refused.exit_code == 2 and "pp x virtual_stages = 2 x 2 entries" in refused.stderr
