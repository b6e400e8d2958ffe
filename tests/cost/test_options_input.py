"""Cost options read from a file (a validation dataset's ``options``): every mistake is one error line naming the
field, the value and what is allowed, and `piper validate` names the file and exits 2 before pricing any row."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from piper_plan.cli.main import cli
from piper_plan.cost.options import CostOptions, cost_options
from piper_plan.errors import PiperError
from piper_plan.validation import load_dataset


@pytest.mark.parametrize("values,message", [
    ({"bogus": 1}, r"^options: bogus: unknown field$"),
    ({"tp_overlap": "abc"}, r"^options: tp_overlap: Input should be a valid number \(got 'abc'\)$"),
    ({"dp_overlap": 1.5}, r"^options: dp_overlap: Input should be less than or equal to 1 \(got 1.5\)$"),
    ({"dropout": "yes"}, r"^options: dropout: Input should be a valid boolean \(got 'yes'\)$"),
    ({"moe_saved_rows": -1}, r"^options: moe_saved_rows: Input should be greater than or equal to 0 \(got -1\)$"),
    ({"moe_saved_rows": 1.5}, r"^options: moe_saved_rows: Input should be a valid integer"),
    ({"recompute_modules": "mlp"}, r"^options: recompute_modules: Input should be a valid array \(got 'mlp'\)$"),
    ({"cross_entropy_fusion_impl": "fused"}, r"cross_entropy_fusion_impl names 'fused'; allowed: native, te$"),
    ({"ep_dispatch": None}, r"^options: ep_dispatch: Input should be a valid string \(got None\)$"),
])
def test_bad_options_are_one_line(values, message):
    with pytest.raises(PiperError, match=message):
        cost_options(values)


def test_good_options_build_the_same_as_the_constructor():
    values = {"moe_saved_rows": 0, "loss_chunk_rows": None, "tp_overlap": 1, "recompute_modules": ["mlp"],
              "cross_entropy_fusion_impl": "te", "shared_expert_overlap": True}
    assert cost_options(values) == CostOptions(**values)


@pytest.mark.parametrize("where", ["dataset", "row"])
def test_validate_names_the_file_and_the_row(tmp_path, where):
    data = load_dataset("megatron-bridge-moe").model_dump(exclude_none=True)
    data["rows"] = data["rows"][:2]
    if where == "dataset":
        data["options"] = dict(data["options"], cross_entropy_fusion_impl="fused")
        field = "options.cross_entropy_fusion_impl"
    else:
        data["rows"][1]["options"] = dict(data["rows"][1]["options"], bogus=1)
        field = f"rows[{data['rows'][1]['id']}].options"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli, ["validate", "--dataset", str(path)])
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]
    assert line.startswith(f"error: {path}: {field}: "), line
