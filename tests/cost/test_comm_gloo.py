"""The all-to-all model's gloo / emulated-network terms (cost/comm.py): relay copies, one latency per exchange,
half-duplex connections, host steps, a shaped link's burst. Each term is off by default, so every other platform's prediction stays as it was."""

from __future__ import annotations

import numpy as np
import pytest

from piper_plan.catalog import catalog_names, load_platform, platforms_dir
from piper_plan.cost.comm import Network, relay_copy_bytes
from piper_plan.specs import PlatformSpec

MiB = 2**20


def netemu(**changes) -> PlatformSpec:
    """platforms/netemu.yaml (2 nodes' worth of figures) with the gloo terms switched as given."""
    data = load_platform("netemu").model_dump()
    data["node"]["relay_copy_GBps"] = changes.get("relay_copy_GBps", 0.0)
    data["network"]["a2a_posts_all"] = changes.get("a2a_posts_all", False)
    data["network"]["half_duplex_connections"] = changes.get("half_duplex", False)
    data["node"]["serial_phases"] = changes.get("serial_phases", False)
    data["node"]["host_step_us"] = changes.get("host_step_us", 0.0)
    data["node"]["halo_step_us"] = changes.get("halo_step_us")
    data["node"]["host_step_hidden"] = changes.get("hidden", 0.0)
    data["network"]["link_burst_bytes"] = changes.get("burst", 0.0)
    data["node"]["nodes_share_host"] = changes.get("shared_host", False)
    return PlatformSpec.model_validate(data)


def test_relay_copy_bytes_by_hand():
    """2 nodes x 2 ranks, S = 1 MiB: phase I rows S/2, phase II rows R = S/2, relay gather R, cat + reorder 2 S:
    3.5 MiB. 4 nodes x 2: S/4 + 3/4 S + 3/4 S + 2 S = 3.75 MiB."""
    assert relay_copy_bytes(4, 2, MiB) == pytest.approx(3.5 * MiB)
    assert relay_copy_bytes(8, 4, MiB) == pytest.approx(3.75 * MiB)


def test_relay_copies_add_to_halo_only():
    """At 1 GB/s per rank the copies add 3.5 MiB / 1e9 s to HALO across nodes; flat and one-node HALO unchanged."""
    base, copying = Network(netemu()), Network(netemu(relay_copy_GBps=1.0))
    halo = [sum(net.a2a_seconds(1, 4, 2, 16 * MiB, 1)) for net in (base, copying)]
    assert halo[1] - halo[0] == pytest.approx(3.5 * 16 * MiB / 1e9)
    for algo, n, nodes, scope in ((0, 4, 2, 1), (1, 2, 1, 0)):
        times = [sum(net.a2a_seconds(algo, n, nodes, 16 * MiB, scope)) for net in (base, copying)]
        assert times[0] == times[1]


def test_posting_all_messages_pays_one_latency():
    """A 4 KiB exchange on 4 nodes x 2 ranks: flat's remote part pays 6 switch latencies when the pairs go one
    after another, one when every message is posted at once (gloo); HALO's phase II 3, or 1."""
    per_peer, at_once = Network(netemu()), Network(netemu(a2a_posts_all=True))
    lat = per_peer.lat[1]
    bytes_term = 4096 * 6 / 8 / per_peer.bw[1]
    _, flat_per_peer, _, _ = per_peer.a2a_phases(8, 4, 4096, 1)
    _, flat_once, _, _ = at_once.a2a_phases(8, 4, 4096, 1)
    connection = per_peer._connection_seconds(4096 / 8, 1)
    assert flat_per_peer == pytest.approx(max(bytes_term + 6 * lat, connection))
    assert flat_once == pytest.approx(max(bytes_term + lat, connection))
    assert flat_once < flat_per_peer


def test_half_duplex_prices_one_way_transfers_at_half_a_sendrecv():
    """2 nodes x 2 ranks, 16 MiB: HALO's phase II sends R = 8 MiB to one relay. A p2p row (sendrecv) moves the
    bytes both ways on one connection; on a half-duplex network one way costs the row of R / 2."""
    full, half = Network(netemu()), Network(netemu(half_duplex=True))
    remote = 8 * MiB
    _, _, ii_full, _ = full.a2a_phases(4, 2, 16 * MiB, 1)
    _, _, ii_half, _ = half.a2a_phases(4, 2, 16 * MiB, 1)
    link = remote / np.maximum(full.bw[1], full._nic_affine_Bps()) + full.lat[1]
    assert ii_full == pytest.approx(max(link, full._connection_seconds(remote, 1)))
    assert ii_half == pytest.approx(max(link, full._connection_seconds(remote / 2, 1)))
    assert ii_half < ii_full
    # flat's pairs carry both directions on one connection: a whole sendrecv row either way
    assert half.a2a_phases(4, 2, 16 * MiB, 1)[1] == full.a2a_phases(4, 2, 16 * MiB, 1)[1]


def test_serial_phases_add_phase_one():
    """Where the ranks' cores are oversubscribed HALO's phase I does not hide behind II + III: the whole exchange
    is I + II + III instead of max(I, II + III)."""
    overlapped, serial = Network(netemu()), Network(netemu(serial_phases=True))
    local, _, remote, redistribute = overlapped.a2a_phases(8, 4, 16 * MiB, 1)
    assert sum(overlapped.a2a_seconds(1, 8, 4, 16 * MiB, 1)) == pytest.approx(max(local, remote + redistribute))
    assert sum(serial.a2a_seconds(1, 8, 4, 16 * MiB, 1)) == pytest.approx(local + remote + redistribute)
    assert sum(serial.a2a_seconds(0, 8, 4, 16 * MiB, 1)) == sum(overlapped.a2a_seconds(0, 8, 4, 16 * MiB, 1))


def test_nodes_sharing_one_host_take_nodes_times_the_intra_node_phases():
    """Emulated nodes on one host (node.nodes_share_host): HALO's phases I and III and flat's local rows take nodes x
    one node's time (every node's at once on the same cores); phase II and flat's remote rows, which cross the
    emulated links, do not change, and neither does an exchange inside one node."""
    alone, shared = Network(netemu()), Network(netemu(shared_host=True))
    for nodes in (2, 4):
        one, many = alone.a2a_phases(2 * nodes, nodes, 16 * MiB, 1), shared.a2a_phases(2 * nodes, nodes, 16 * MiB, 1)
        assert many[0] == pytest.approx(nodes * one[0]) and many[3] == pytest.approx(nodes * one[3])
        assert (many[1], many[2]) == pytest.approx((one[1], one[2]))
        assert sum(shared.a2a_seconds(1, 2 * nodes, nodes, 16 * MiB, 1)) > sum(alone.a2a_seconds(1, 2 * nodes, nodes, 16 * MiB, 1))
    assert sum(shared.a2a_seconds(0, 2, 1, 16 * MiB, 0)) == sum(alone.a2a_seconds(0, 2, 1, 16 * MiB, 0))
    assert load_platform("netemu").node.nodes_share_host


def test_host_step_is_paid_once_by_flat_and_per_phase_by_halo():
    """1 ms per dependent step: flat (one exchange) takes 1 ms longer, HALO with its phases in series 3 ms (I, II,
    III), with them overlapped 2 ms (max(I, II + III), II + III the longer here); one-node HALO is flat."""
    for serial, halo_steps in ((True, 3), (False, 2)):
        base = Network(netemu(serial_phases=serial))
        stepped = Network(netemu(serial_phases=serial, host_step_us=1000.0))
        for algo, n, nodes, scope, steps in ((0, 8, 4, 1, 1), (1, 8, 4, 1, halo_steps), (1, 2, 1, 0, 1)):
            times = [sum(net.a2a_seconds(algo, n, nodes, 64 * 1024, scope)) for net in (base, stepped)]
            assert times[1] - times[0] == pytest.approx(steps * 1e-3)


def test_a_links_burst_takes_its_bytes_off_the_busiest_nic():
    """tbf passes its bucket (64 KiB) at once: on 4 nodes x 2 ranks at 0.1 GB/s per NIC the remote bandwidth term
    of flat and of HALO's phase II (there the NIC's, not one connection's, time) loses 64 KiB / 0.1 GB/s =
    0.655 ms, never below nothing: an exchange smaller than the burst keeps only its latency (and its one
    connection's p2p time)."""
    plain, bursty = Network(netemu()), Network(netemu(burst=65536.0))
    nic_Bps = plain.platform.node.nic_bandwidth_GBps * 1e9
    big = [net.a2a_phases(8, 4, 16 * MiB, 1) for net in (plain, bursty)]
    assert big[0][1] - big[1][1] == pytest.approx(65536 / nic_Bps)     # flat's remote part
    assert big[0][2] - big[1][2] == pytest.approx(65536 / nic_Bps)     # HALO's phase II
    assert big[0][0] == big[1][0] and big[0][3] == big[1][3]            # phases I and III stay inside the node
    _, flat_small, halo_small, _ = bursty.a2a_phases(4, 2, 16 * 1024, 1)
    lat = bursty.lat[1]
    assert flat_small == pytest.approx(max(2 * lat, bursty._connection_seconds(16 * 1024 / 4, 1)))  # 2 remote peers
    assert halo_small == pytest.approx(max(lat, bursty._one_way_seconds(8 * 1024, 1)))


def test_no_exchange_pays_no_host_step():
    """ep = 1 (one rank) exchanges nothing: no host step, whatever the platform's."""
    stepped = Network(netemu(host_step_us=1000.0, halo_step_us=3000.0))
    for algo in (0, 1):
        assert sum(stepped.a2a_seconds(algo, 1, 1, 16 * MiB, 0)) == 0.0


def test_halo_phases_pay_their_own_step_where_one_is_set():
    """host step 1 ms, HALO step 3 ms: flat +1 ms; HALO across nodes +9 ms in series (3 phases), +6 ms overlapped
    (max(I, II + III): two steps on the longer path); one-node HALO is flat: +1 ms."""
    for serial, halo_ms in ((True, 9), (False, 6)):
        base = Network(netemu(serial_phases=serial))
        stepped = Network(netemu(serial_phases=serial, host_step_us=1000.0, halo_step_us=3000.0))
        for algo, n, nodes, scope, ms in ((0, 8, 4, 1, 1), (1, 8, 4, 1, halo_ms), (1, 2, 1, 0, 1)):
            times = [sum(net.a2a_seconds(algo, n, nodes, 64 * 1024, scope)) for net in (base, stepped)]
            assert times[1] - times[0] == pytest.approx(ms * 1e-3)


@pytest.mark.parametrize("nbytes", [4096, 16 * MiB])
def test_a_hidden_share_of_the_host_step_runs_under_the_wire(nbytes):
    """host_step_hidden 0.4 with a 1 ms step: flat across nodes is 0.4 x min(1 ms, its remote time) shorter, HALO
    (phases in series) 0.4 x min(1 ms, phase II) shorter, the step of phases I and III (no wire) kept; a one-node
    exchange has no wire to hide under and keeps its whole step."""
    stepped = Network(netemu(serial_phases=True, host_step_us=1000.0))
    hidden = Network(netemu(serial_phases=True, host_step_us=1000.0, hidden=0.4))
    _, flat_remote, halo_remote, _ = stepped.a2a_phases(8, 4, nbytes, 1)
    for algo, n, nodes, scope, wire in ((0, 8, 4, 1, flat_remote), (1, 8, 4, 1, halo_remote), (0, 2, 1, 0, 0.0)):
        times = [sum(net.a2a_seconds(algo, n, nodes, nbytes, scope)) for net in (stepped, hidden)]
        assert times[0] - times[1] == pytest.approx(0.4 * min(1e-3, wire), abs=1e-12)
    assert (halo_remote < 1e-3) == (nbytes < MiB)        # both sides of the min: HALO's 4 KiB phase II is shorter


@pytest.mark.parametrize("name", [p for p in catalog_names(platforms_dir()) if p != "netemu"])
def test_other_platforms_keep_the_terms_off(name):
    """No shipped platform but the emulated network sets a gloo term: their predictions are as before."""
    platform = load_platform(name)
    assert platform.node.relay_copy_GBps == 0
    assert not platform.network.a2a_posts_all and not platform.network.half_duplex_connections
    assert not platform.node.serial_phases
    assert platform.node.host_step_us == 0 and platform.node.halo_step_us is None
    assert platform.node.host_step_hidden == 0
    assert platform.network.link_burst_bytes == 0
