"""Every catalog platform loads, cites its numbers, and plans a MoE model through the CLI without a traceback.

The catalog is read as it is on disk (platforms/*.yaml): a new file is covered without editing this test.
"""

import json

import pytest
import yaml
from click.testing import CliRunner

from piper_plan.catalog import catalog_names, load_platform, platforms_dir, read_structured
from piper_plan.cli.main import cli

PLATFORMS = catalog_names(platforms_dir())
GPU_PLATFORMS = ["dgx-h100", "h200", "dgx-b200", "gb200-nvl72", "mi300x", "mi355x"]
"""The platforms whose inter-node scopes carry a measured (or transferred) all-to-all efficiency, not line rate."""
PLAN_EXIT_CODES = (0, 3)
"""piper plan: 0 = plans ranked, 3 = nothing fits."""


def raw_platform(name: str) -> dict:
    return read_structured(platforms_dir() / f"{name}.yaml")


def source_fields(data, path="") -> list[tuple[str, object]]:
    """(dotted path, value) of every ``source`` key in a nested YAML mapping."""
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            here = f"{path}.{key}" if path else str(key)
            if key == "source":
                found.append((here, value))
            found += source_fields(value, here)
    elif isinstance(data, list):
        for i, item in enumerate(data):
            found += source_fields(item, f"{path}[{i}]")
    return found


def test_the_catalog_has_the_current_machines():
    assert set(GPU_PLATFORMS) <= set(PLATFORMS)


@pytest.mark.parametrize("name", PLATFORMS)
def test_platform_loads(name):
    spec = load_platform(name)
    assert spec.name == name
    assert spec.node_limit >= 1


@pytest.mark.parametrize("name", PLATFORMS)
def test_every_section_cites_a_source_and_none_is_from_memory(name):
    data = raw_platform(name)
    sources = dict(source_fields(data))
    sections = ["device", "node", "network", "efficiency", "memory", "launch"]
    sections += [f"node.link_classes[{i}]" for i in range(len(data["node"]["link_classes"]))]
    sections += [f"network.scopes.{scope}" for scope in data["network"]["scopes"]]
    missing = [s for s in sections if not str(sources.get(f"{s}.source", "")).strip()]
    assert not missing, f"{name}: no source for {missing}"
    from_memory = [path for path, text in sources.items() if "from memory" in str(text).lower()]
    assert not from_memory, f"{name}: 'from memory' in {from_memory}"


@pytest.mark.parametrize("name", GPU_PLATFORMS)
def test_inter_node_scopes_are_priced_below_nic_line_rate(name):
    """The measured all-to-all efficiency is applied: no scope beyond the NVLink / Infinity Fabric domain runs at
    100% of the per-device NIC rate."""
    spec = load_platform(name)
    nic_per_device_GBps = spec.node.injection_GBps / spec.devices_per_node
    widest = spec.network.scopes["system"]
    assert widest.bandwidth_GBps < nic_per_device_GBps


@pytest.mark.parametrize("name", GPU_PLATFORMS)
def test_fp8_peak_is_twice_bf16_dense(name):
    """Vendors quote both rates dense or both sparse; a mixed pair would be 1x or 4x apart, not 2x."""
    peaks = load_platform(name).device.peak_flops
    assert peaks["fp8"] / peaks["bf16"] == pytest.approx(2.0, rel=0.01)


def test_gb200_nvl72_maps_its_72_gpu_nvlink_domain_to_the_switch_scope():
    spec = load_platform("gb200-nvl72")
    assert spec.devices_per_node == 4
    assert spec.network.nodes_per_switch * spec.devices_per_node == 72
    scopes = spec.network.scopes
    # one NVLink path for every pair of the rack; the all-to-all rate measured over more peers (36 ranks) is lower
    # than over 8 (HybridEP on GB200), and both are NVLink rates, ten times the InfiniBand group scope's
    assert scopes["switch"].bandwidth_GBps <= scopes["node"].bandwidth_GBps
    assert scopes["switch"].bandwidth_GBps > 10 * scopes["group"].bandwidth_GBps


def test_piper_platforms_lists_every_catalog_file():
    result = CliRunner().invoke(cli, ["platforms", "--json"])
    assert result.exit_code == 0, result.output
    assert {row["name"] for row in json.loads(result.stdout)} == set(PLATFORMS)


@pytest.mark.parametrize("name", GPU_PLATFORMS)
def test_plan_mixtral_runs_on_each_gpu_platform(name):
    nodes = min(2, load_platform(name).node_limit)
    result = CliRunner().invoke(cli, ["plan", "--model", "mixtral-8x7b", "--platform", name,
                                      "--nodes", str(nodes), "--json"])
    assert result.exit_code in PLAN_EXIT_CODES, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    if result.exit_code == 0:
        out = json.loads(result.stdout)
        assert out["platform"] == name and out["plans"]


@pytest.mark.parametrize("name", GPU_PLATFORMS)
def test_launch_renders_each_gpu_platforms_template(name, tmp_path):
    spec = load_platform(name)
    result = CliRunner().invoke(cli, ["launch", "--model", "mixtral-8x7b", "--platform", name, "--nodes", "2",
                                      "--out", str(tmp_path / "job"), "--dry-run"])
    assert result.exit_code == 0, result.output
    script = result.stdout
    assert f"--ntasks-per-node={spec.devices_per_node}" in script
    assert f"--cpus-per-task={spec.launch.cpus_per_task}" in script
    assert "{{" not in script


@pytest.mark.parametrize("section", ["device", "network.scopes.node", "efficiency"])
@pytest.mark.parametrize("text, needle", [("  ", "a source is required"),
                                          ("bandwidth From Memory", "'from memory' is not a source")])
def test_a_platform_file_whose_source_is_blank_or_from_memory_is_refused(tmp_path, section, text, needle):
    """What the catalog test checks of piper's own files holds for a user's too: one error line, exit 2."""
    data = raw_platform("dgx-h100")
    node = data
    for key in section.split("."):
        node = node[key]
    node["source"] = text
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(cli, ["plan", "--model", "qwen3-30b-a3b", "--platform", str(path), "--nodes", "1"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"{path}: {section}.source: {needle}" in res.stderr


def _edited(tmp_path, name: str, edit) -> str:
    data = raw_platform(name)
    edit(data["network"])
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("taper", [1e-300, 1000.0, 2.0])
def test_a_global_taper_the_system_scope_does_not_show_is_refused(tmp_path, taper):
    """Before: any taper was shown by `platform show` and priced nowhere (the step time did not move)."""
    path = _edited(tmp_path, "dgx-h100", lambda net: net.update(global_taper=taper))
    res = CliRunner().invoke(cli, ["platform", "show", path])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"global_taper = {taper:g}, but scopes.system.bandwidth_GBps = 43 is not scopes.group's 43" in res.stderr


def test_a_multi_node_platform_with_only_the_node_scope_is_refused(tmp_path):
    """Before: every inter-node transfer was priced at the node scope's NVLink rate (DSV3 on 32 H100 nodes: 13.64 s
    against 29.66 s with the platform's own scopes)."""
    path = _edited(tmp_path, "dgx-h100", lambda net: net.update(scopes={"node": net["scopes"]["node"]}))
    res = CliRunner().invoke(cli, ["estimate", "--model", "qwen3-30b-a3b", "--platform", path, "--nodes", "2",
                                   "--dp", "16", "--ep", "8", "--global-batch", "64"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "network.scopes lists only 'node': a platform of 2,048 nodes needs" in res.stderr


def test_a_link_class_named_twice_is_refused():
    """Two link classes of one name were both kept (and listed twice by platform show)."""
    from pydantic import ValidationError

    data = load_platform("frontier").model_dump(mode="json")
    data["node"]["link_classes"].append(dict(data["node"]["link_classes"][0]))
    with pytest.raises(ValidationError, match="is named twice"):
        type(load_platform("frontier")).model_validate(data)


def test_h200_takes_dgx_h100s_host_constant():
    """The host time of a GEMM call is the host's: a DGX H200 has the DGX H100's CPUs and the same SM90 GPU, so it
    takes dgx-h100's fitted constant (platforms/h200.yaml says so); a refit of dgx-h100 must carry to h200."""
    h100, h200 = (load_platform(n).efficiency.host_s_per_gemm_call for n in ("dgx-h100", "h200"))
    assert h200 == h100 is not None
