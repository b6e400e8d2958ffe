"""benchmarks/halo_phases.py --uplink-use: how busy a node keeps its busiest uplink in one exchange, from sampled
byte counters (benchmarks/halo_network.py reports it beside the model), and the report's reading of incomplete
measurement files. Pure arithmetic: no network."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def phases():
    spec = importlib.util.spec_from_file_location("halo_phases", ROOT / "benchmarks" / "halo_phases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counters(rates_Bps: list[tuple[float, float]], dt: float = 0.01, start: float = 100.0) -> list[list[float]]:
    """Sampled (time, bytes up0, bytes up1) rows: up0 and up1 sending at the given rates in each interval."""
    rows, sent = [[start, 0.0, 0.0]], [0.0, 0.0]
    for up0, up1 in rates_Bps:
        sent = [sent[0] + up0 * dt, sent[1] + up1 * dt]
        rows.append([rows[-1][0] + dt, *sent])
    return rows


def test_a_saturated_busiest_uplink_is_used_fully_and_an_idle_half_is_counted(phases):
    rate = 1e8
    full = phases.call_link_use(counters([(rate, rate / 3)] * 10), 100.0, 0.105, rate)
    assert full["utilization"] == pytest.approx(1.0) and full["below_half"] == 0.0
    assert full["busiest_share"] == pytest.approx(0.75)
    stalled = phases.call_link_use(counters([(rate, 0.0)] * 6 + [(0.2 * rate, 0.0)] * 4), 100.0, 0.105, rate)
    assert stalled["utilization"] == pytest.approx(0.68) and stalled["below_half"] == pytest.approx(0.4)
    assert phases.call_link_use(counters([(rate, 0.0)] * 3), 100.0, 0.005, rate) == {}   # one sample inside


def test_the_fastest_call_is_reported_with_the_mean_over_nodes(phases):
    def call(seconds, use):
        return {"seconds": seconds, "utilization": use, "busiest_share": 0.75, "below_half": 1 - use}

    nodes = [{"flat": [call(0.5, 0.7), call(0.4, 0.9)]}, {"flat": [call(0.5, 0.8), call(0.4, 0.7)]}]
    fastest, median, calls = phases.use_figures(nodes, "flat")
    assert calls == 2 and fastest["seconds"] == 0.4 and fastest["utilization"] == pytest.approx(0.8)
    assert median["utilization"] == pytest.approx(0.775)
    nodes[1]["flat"][0] = {"seconds": 0.5}                                  # a node sampled nothing in call 1
    assert phases.use_figures(nodes, "flat")[2] == 1


def test_the_report_reads_incomplete_measurement_files(tmp_path):
    spec = importlib.util.spec_from_file_location("halo_network", ROOT / "benchmarks" / "halo_network.py")
    network = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(network)
    call = {"seconds": 0.2, "utilization": 0.9, "busiest_share": 0.75, "below_half": 0.05}
    rate = f"{network.SHARE_RATE_GBps:g}"
    unsampled = [{"flat": [call], "halo": [{"seconds": 0.3}]}, {"flat": [call], "halo": []}]  # HALO unsampled
    files = {"2x2": {str(network.USE_BYTES): unsampled},
             "2x4": {"4096": [{"flat": [call], "halo": [call]}]}}          # another size only: left out
    for shape, text in files.items():
        (tmp_path / f"uplink-use-{rate}-{shape}.json").write_text(json.dumps(text))
    uses = network.measured_uplink_use(tmp_path, measure=False)
    assert list(uses) == ["2x2"] and uses["2x2"]["halo"] is None and uses["2x2"]["flat"]["utilization"] == 0.9
    table = network.uplink_use_table(uses)
    assert table[-1] == "| 2 x 2 | 200.0 | 0.90 | 5% | - | - | - |"
