"""benchmarks/halo_phases.py --uplink-use: how busy a node keeps its busiest uplink in one exchange, from sampled
byte counters (benchmarks/halo_network.py reports it beside the model), and the report's reading of incomplete
measurement files. Pure arithmetic: no network."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def phases():
    return benchmark("halo_phases")


@pytest.fixture(scope="module")
def network():
    return benchmark("halo_network")


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


def test_the_report_reads_incomplete_measurement_files(tmp_path, network):
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


def test_the_repeatability_bound_names_points_no_model_can_meet_in_both_sweeps(network):
    """Two sweeps of the same points: times more than 1.15 / 0.85 apart leave no value within 15% of both
    (7.4 and 11.1 ms, 1.50x apart, have none; 6.8 and 5.7 ms, 1.19x, share 5.8 - 6.6 ms), and a
    speedup whose sign changes between the sweeps can be predicted right in one of them at most."""
    point = {"rate_GBps": 0.05, "nodes": 2, "ranks_per_node": 4, "bytes": 262144}
    big = {"rate_GBps": 0.2, "nodes": 2, "ranks_per_node": 4, "bytes": 16 * 2**20}
    first = [{**point, "flat_s": 6.8e-3, "halo_s": 7.4e-3}, {**big, "flat_s": 0.1346, "halo_s": 0.2169}]
    second = [{**point, "flat_s": 5.7e-3, "halo_s": 11.1e-3}, {**big, "flat_s": 0.1805, "halo_s": 0.1688}]
    (text,) = network.repeatability_bound(first, second)
    assert "at 0 flat and 1 HALO points" in text and "HALO: 0.05 GB/s 2x4 256 KiB)" in text
    assert "at most 2/2 flat and 1/2 HALO points within 15% of both" in text
    assert "differs between the sweeps at 1 of 2 points (0.2 GB/s 2x4 16384 KiB)" in text


SS_TIN = """State Recv-Q Send-Q Local Address:Port Peer Address:Port
ESTAB 0 0 10.231.0.1:38857 10.231.0.2:43266
\t cubic wscale:7,7 rtt:31.5/2 bytes_sent:4200000 busy:300ms rwnd_limited:20ms(6.7%) cwnd:68
ESTAB 0 0 10.231.0.1:38857 10.231.0.3:58484
\t bbr bytes_sent:4200000 busy:100ms cwnd:38
ESTAB 0 0 10.231.1.1:36683 10.231.1.2:45728
\t bbr bytes_sent:1000000 busy:50ms sndbuf_limited:5ms(10%)
ESTAB 0 0 10.231.0.1:37082 10.231.0.1:38857
\t bbr bytes_sent:9999999 busy:48ms
ESTAB 0 0 10.231.0.1:41000 10.231.0.4:39608
\t bbr bytes_sent:1000 busy:1ms
"""


def test_flat_connections_on_the_busiest_uplink_from_ss_counters(phases):
    """``ss -tin`` -> the connections between emulated nodes (a node's own loopback pair is left out), and one
    call's figures for its busiest uplink: only the connections that carried the exchange (not another group's
    few bytes), each one's busy time, and the link's time held back by window and buffer."""
    after = phases.parse_tcp_flows(SS_TIN)
    assert set(after) == {"10.231.0.1:38857>10.231.0.2:43266", "10.231.0.1:38857>10.231.0.3:58484",
                          "10.231.1.1:36683>10.231.1.2:45728", "10.231.0.1:41000>10.231.0.4:39608"}
    assert after["10.231.0.1:38857>10.231.0.2:43266"] == {"busy_ms": 300, "rwnd_ms": 20, "sndbuf_ms": 0,
                                                          "sent": 4200000}
    before = {"10.231.0.1:38857>10.231.0.2:43266": {"busy_ms": 100, "rwnd_ms": 10, "sndbuf_ms": 0, "sent": 2100000}}
    call = phases.call_flows(before, after, 0.4)
    assert call["uplink"] == 0 and call["MB"] == [2.1, 4.2] and call["busy_ms"] == [200, 100]
    assert call["rwnd_ms"] == 10 and call["sndbuf_ms"] == 0


def test_the_host_step_exchange_is_the_median_of_every_round_in_the_run(tmp_path, network):
    """The tiny exchange behind the host steps is timed in rounds spread over a run (at the start, before each test
    rate's points); a slow spell moves one round, and the figure is the median over all of them."""

    def sizes(*flat_halo):
        return {"sizes": [{"seconds": {"flat": f, "halo": h}} for f, h in flat_halo]}

    (tmp_path / "tiny-0.1-2x2-start.json").write_text(json.dumps(sizes((4.2e-3, 13e-3), (6.1e-3, 10e-3), (2.7e-3, 5e-3))))
    (tmp_path / "tiny-0.1-2x2-before-0.05.json").write_text(json.dumps(sizes((1.1e-3, 2.8e-3), (1.0e-3, 2.0e-3),
                                                                             (1.1e-3, 3.0e-3))))
    (tmp_path / "tiny-0.1-2x2-before-0.2.json").write_text(json.dumps(sizes((1.2e-3, 3.1e-3), (1.3e-3, 4.0e-3),
                                                                            (1.0e-3, 2.9e-3))))
    tiny = network.tiny_seconds(tmp_path)
    assert tiny == {"2x2": {"flat": pytest.approx(1.2e-3), "halo": pytest.approx(3.1e-3)}}


def test_the_hidden_share_of_the_host_step_is_fitted_at_the_other_rate(network):
    """node.host_step_hidden comes from the flat 1 MiB exchange measured at 0.1 GB/s on the shape (a rate no test
    point uses), priced there with the test rate's platform: a measurement made by the model at 0.4 gives back 0.4;
    one slower than the whole step gives 0, one faster than no step at all 1; no row, or no host step, leaves it."""
    from piper_plan.catalog import load_platform

    data = load_platform("netemu").model_dump()
    data["node"]["host_step_us"] = 2000.0
    platform = type(load_platform("netemu")).model_validate(data)

    def measured_at(hidden: float) -> dict:
        data["node"]["host_step_hidden"] = hidden
        there = network.at_rate(type(platform).model_validate(data), 0.05, network.SHARE_RATE_GBps)
        flat = network.predict(there, None, 2, 2, network.HIDDEN_FIT_BYTES)["flat"]
        return {"sizes": [{"bytes_per_rank": 4096, "seconds": {"flat": 1.0}},
                          {"bytes_per_rank": network.HIDDEN_FIT_BYTES, "seconds": {"flat": flat}}]}

    def fitted(row):
        return network.with_hidden_step(platform, None, 2, 2, 0.05, row).node.host_step_hidden

    assert fitted(measured_at(0.4)) == pytest.approx(0.4)
    slow, fast = measured_at(0.0), measured_at(1.0)
    slow["sizes"][1]["seconds"]["flat"] += 1e-3
    fast["sizes"][1]["seconds"]["flat"] -= 1e-3
    assert (fitted(slow), fitted(fast)) == (0.0, 1.0)
    assert fitted(None) == 0.0 and fitted({"sizes": []}) == 0.0
    data["node"]["host_step_us"], data["node"]["host_step_hidden"] = 0.0, 0.0
    unstepped = type(platform).model_validate(data)
    assert network.with_hidden_step(unstepped, None, 2, 2, 0.05, measured_at(0.4)) is unstepped


def test_two_shaping_checks_give_each_rate_the_faster_reading(network):
    # a slow spell of the host lowered every transfer of the first check; the second, minutes later, did not
    keys = network.SHAPING_GBPS
    before = dict(zip(keys, (0.159, 1.44, 0.079, 0.109)), bytes=16 * 2**20, statistic="fastest of 5")
    after = dict(zip(keys, (0.190, 3.20, 0.095, None)), bytes=16 * 2**20, statistic="fastest of 5")
    merged = network.fastest_check(before, after)
    assert [merged[k] for k in keys] == [0.190, 3.20, 0.095, 0.109]
    assert merged["checks"] == {"before": {k: before[k] for k in keys}, "after": {k: after[k] for k in keys}}
    assert "two checks" in merged["statistic"] and merged["bytes"] == 16 * 2**20
    assert network.half_duplex(merged) and network.half_duplex(before)   # one connection: 0.095 / 0.190, 0.079 / 0.159


def test_a_repeat_of_a_one_check_sweep_keeps_its_check_and_old_checks_merge(network):
    # the repeat of an OUT with one check copies it as the second: the check as it was, its statistic kept
    keys = network.SHAPING_GBPS
    once = dict(zip(keys, (0.19, 3.0, 0.095, 0.19)), bytes=16 * 2**20, statistic="median of 3")
    assert network.fastest_check({**once, "figures": {"node_GBps": 1.0}}, dict(once)) == {**once, "figures": {"node_GBps": 1.0}}
    # a check from before the two-way transfers has no two-way figures: merged without them
    old = {"inter_node_GBps": 0.18, "intra_node_GBps": 2.0, "bytes": 16 * 2**20}
    merged = network.fastest_check(old, once)
    assert merged["inter_node_GBps"] == 0.19 and merged["two_way_one_connection_GBps"] == 0.095
    assert merged["checks"]["before"]["two_way_two_connections_GBps"] is None


def test_flats_link_use_on_three_nodes_prices_flat_on_three_or_more_only(network):
    """Flat's link use is the model's time for flat on 3 x 2 over the measured time, at most 1 (no faster than the
    model's link); it slows flat's inter-node rate on shapes of 3 or more nodes by that share and leaves two-node
    shapes, and a sweep without the measurement, as they were."""
    from piper_plan.catalog import load_platform

    assert network.link_use(0.08, 0.1) == pytest.approx(0.8)
    assert network.link_use(0.12, 0.1) == 1.0 and network.link_use(0.1, None) is None
    platform = load_platform("netemu")
    nbytes = 16 * 2**20
    base = {nodes: network.predict(platform, None, nodes, 2, nbytes) for nodes in (2, 3, 4)}
    for nodes in (3, 4):
        used = network.predict(network.with_link_use(platform, nodes, 0.8), None, nodes, 2, nbytes)
        assert used["flat"] == pytest.approx(base[nodes]["flat"] / 0.8, rel=0.02)   # the wire term is most of it
    assert network.with_link_use(platform, 2, 0.8) is platform
    assert network.with_link_use(platform, 4, None) is platform


def test_the_exchange_on_three_nodes_keeps_the_median_of_its_timings(network, tmp_path):
    """HALO's copy rate and flat's link use come from flat and HALO on 3 x 2 timed before a rate's points, between
    their first and second rounds, and after them: per algorithm the median figure (neither one slow spell nor one
    fast call moves it; of two timings their mean); an OUT with one timing, or with HALO alone (the oldest sweeps),
    keeps what it has; nothing is measured when no timing is asked for."""
    from piper_plan.calibration.netemu import NetworkSpec

    spec = NetworkSpec(0.2, 2)
    stem = tmp_path / "halo-copies-0.2-3x2"

    def timing(path, **seconds):
        path.write_text(json.dumps({"sizes": [{"bytes_per_rank": 16 * 2**20, "seconds": seconds}]}))

    timing(Path(f"{stem}.json"), flat=0.116, halo=0.219)
    assert network.in_exchange_seconds(tmp_path, spec, None) == {"flat": 0.116, "halo": 0.219}
    timing(Path(f"{stem}-after.json"), flat=0.120, halo=0.150)
    assert network.in_exchange_seconds(tmp_path, spec, None) == pytest.approx({"flat": 0.118, "halo": 0.1845})
    timing(Path(f"{stem}-mid.json"), flat=0.101, halo=0.210)   # one fast flat call, one slow spell's HALO: the middle
    assert network.in_exchange_seconds(tmp_path, spec, None) == {"flat": 0.116, "halo": 0.210}
    timing(Path(f"{stem}-after.json"), halo=0.150)
    timing(Path(f"{stem}-mid.json"), halo=0.160)
    timing(Path(f"{stem}.json"), halo=0.219)
    assert network.in_exchange_seconds(tmp_path, spec, "-after") == {"halo": 0.160}   # present: not measured again


def test_the_copy_rate_prices_the_emulated_networks_host_work_per_shape(network):
    """copies_beside_network_GBps: on the shape it is measured on, the in-exchange rate itself; a shape sending
    more of its bytes across the network than it copies (4 x 2) gets a slower rate, one sending fewer (2 x 2, 2 x 4)
    a faster one, never above the copies alone; without the in-exchange figure, or switched off, the one rate."""
    copies = {"host_GBps": 13.0, "host_cores": 2}
    check = {"copies_in_exchange": {"host_GBps": 5.0}}
    nodes, g = network.IN_EXCHANGE_SHAPE
    rate = lambda n, r, c=copies, k=check: network.copies_beside_network_GBps(c, k, n, r)   # noqa: E731
    assert rate(nodes, g) == pytest.approx(5.0)
    assert rate(4, 2) < 5.0 < rate(2, 2) <= 13.0 and 5.0 < rate(2, 4) <= 13.0
    assert rate(4, 2, {**copies, "network_host_work": False}) == 5.0
    assert rate(4, 2, copies, {}) == 13.0                      # no in-exchange figure: the copies alone


def test_copies_inside_an_exchange_are_never_priced_faster_than_alone(network):
    """The in-exchange copy rate is the exchange's time less its modelled phases; where that comes out above the
    copies alone (sweep AJ at 0.2 GB/s: 7.30 against 6.03 GB/s), the copies are priced at the rate alone, on every
    shape."""
    copies = {"host_GBps": 6.0, "host_cores": 2}
    check = {"copies_in_exchange": {"host_GBps": 7.3}}
    assert network.copy_host_GBps(copies, check) == 6.0
    assert network.copy_host_GBps(copies, {"copies_in_exchange": {"host_GBps": 5.0}}) == 5.0
    for shape in ((2, 2), (2, 4), (4, 2), network.IN_EXCHANGE_SHAPE):
        assert network.copies_beside_network_GBps(copies, check, *shape) == 6.0


def test_a_test_point_is_the_median_of_its_rounds(network):
    """point_rows: per size and algorithm the median of the rounds' figures (one slow round does not move the point),
    every round kept beside it, the highest load any round saw; the report says how many rounds a point took."""
    from piper_plan.calibration.bench_a2a import BenchResult, SizeResult

    def result(flat_s: float, halo_s: float, load: float | None) -> BenchResult:
        sizes = (SizeResult(4096, {"flat": 0.001, "halo": 0.002}, load_avg=load),
                 SizeResult(262144, {"flat": flat_s, "halo": halo_s}, load_avg=load))
        return BenchResult(2, 4, "gloo", True, sizes)

    rows = network.point_rows(0.2, 2, 4, [result(0.0028, 0.0075, 4.1), result(0.0040, 0.0061, 5.2),
                                          result(0.0027, 0.0066, None)])
    assert [r["bytes"] for r in rows] == [4096, 262144]
    big = rows[1]
    assert big["flat_s"] == 0.0028 and big["halo_s"] == 0.0066          # the middle round, not the fastest or slowest
    assert big["flat_rounds_s"] == [0.0028, 0.0040, 0.0027] and big["load_avg"] == 5.2
    assert "median of 3 rounds" in network.point_rounds_text(rows)
    one = network.point_rows(0.2, 2, 4, [result(0.0028, 0.0075, None)])
    assert one[1]["flat_s"] == 0.0028 and one[1]["load_avg"] is None
    assert network.point_rounds_text([{"flat_s": 1.0}]) == "a test point measured once; "   # an OUT from before rounds
