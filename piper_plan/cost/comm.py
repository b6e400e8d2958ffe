"""Communication time of collectives per network scope: calibrated curves when present, else alpha-beta.

``bytes_per_rank`` follows nccl-tests' ``size`` per op (all_reduce: the buffer; all_gather / reduce_scatter:
the full gathered buffer; all_to_all: a rank's whole send buffer; p2p: the message). Alpha-beta fallback
(Thakur, Rabenseifner & Gropp 2005; the busbw factors of nccl-tests' PERFORMANCE.md), with the per-rank
bandwidth B and latency alpha of the widest scope the group crosses (PlatformSpec.network.scopes):

    all_reduce      2 (n-1)/n S / B + 2 (n-1) alpha       (ring)
    reduce_scatter  (n-1)/n S / B + (n-1) alpha           all_gather: the same
    all_to_all      (n-1)/n S / B + (n-1) alpha           (one scope; multi-node: see a2a_seconds)
    p2p             S / B + alpha

Expert all-to-all over a group of n ranks on ``nodes`` nodes, g = n / nodes ranks per node, each rank
sending S bytes (S / n per peer); local bytes L = S (g-1)/n, remote R = S (n-g)/n:

- flat: intra- and inter-node peers at once, one message per peer:
  ``max(L / B_node + (g-1) alpha_node, R / B_scope + (n-g) alpha_scope)``
- HALO (Piper paper): phase I (local rows, intra-node) runs beside phase II (remote rows packed per
  destination node, one message per remote node to the NIC-affine relay), then phase III redistributes what
  arrived inside the node: (g-1)/g of R. The runtime (runtime/halo.py) starts III when II has finished:
  ``max(I, II + III)``. [the paper gives no formula; the schedule is the runtime's]
- NIC use: flat's messages go to every peer whatever NIC it sits behind, so its per-rank bandwidth is the
  scope's figure (what a flat exchange gets, e.g. a NIC shared unevenly); HALO's phase II is NIC-affine (local
  rank j of node A sends to local rank j of node B, same NIC index), so inside one switch it gets every NIC of
  the node evenly: per rank ``nic_bandwidth / (ranks on the busiest NIC)`` (platform node.num_nics,
  device_nic), never less than the scope's figure; at wider scopes the fabric's figure holds for both.
  A single connection carries at most what one point-to-point transfer gets (the ``p2p`` curve where
  calibrated): flat sends S/n bytes per peer, HALO R/(nodes-1) per relay. Measured on the emulated network
  (docs/halo-measured.md). On one node HALO is flat.
- Where the platform says so (defaults keep the terms above exactly): ``network.a2a_posts_all`` (gloo's
  alltoallv posts every message before waiting: one latency per exchange, not per peer);
  ``network.half_duplex_connections`` (one gloo TCP connection carries one direction at a time: a p2p row, a
  sendrecv on one connection, moves 2 b in turn, so HALO's phase II, each direction on its own communicator,
  costs the row of b / 2 per relay, while flat's pairs pay the whole row); ``node.relay_copy_GBps`` (HALO's row
  gathers and final reorder on the rank, ``relay_copy_bytes``, in series with the phases:
  ``max(I, II + III) + copies``); ``node.serial_phases`` (CPU ranks on fewer cores than ranks: phase I does not
  overlap II + III, ``I + II + III + copies``); ``node.nodes_share_host`` (an emulated network whose nodes all
  run on one host: the intra-node rows, phases I and III and flat's local part, take ``nodes`` x one node's time,
  every node's at once on the same cores); ``node.host_step_us`` (each dependent step, a flat exchange or
  one HALO phase, waits that long for the host: flat pays it once, HALO three times in series and twice on its
  critical path when phase I overlaps (``max(I, II + III)``), at ``node.halo_step_us`` where that is set; of a
  step with an inter-node transfer, flat's exchange or HALO's phase II, ``node.host_step_hidden`` x the shorter of
  step and transfer runs under the transfer); ``network.link_burst_bytes``
  (a shaped link's token bucket passes that much at once: the busiest NIC's wire time is
  ``max(bytes - burst, 0) / rate``, i.e. the remote bandwidth terms less burst / NIC rate). Measured on the
  emulated network: docs/halo-measured.md.
"""

from __future__ import annotations

import numpy as np

from piper_plan.specs.platform import SCOPES, PlatformSpec
from piper_plan.specs.vocab import A2A, CollectiveOp



def scope_tables(platform: PlatformSpec) -> tuple[np.ndarray, np.ndarray]:
    """(bandwidth B/s, latency s) per scope index; a scope the platform does not list takes the next wider one."""
    scopes = platform.network.scopes
    bw, lat = np.zeros(len(SCOPES)), np.zeros(len(SCOPES))
    known = [s for s in SCOPES if s in scopes]
    for i, name in enumerate(SCOPES):
        use = name if name in scopes else next((s for s in known if SCOPES.index(s) >= i), known[-1])
        bw[i], lat[i] = scopes[use].bandwidth_GBps * 1e9, scopes[use].latency_us * 1e-6
    return bw, lat


def alpha_beta_seconds(op: str, n, nbytes, bandwidth_Bps, latency_s):
    """Alpha-beta time of one collective (see the module docstring); 0 when n == 1."""
    n = np.asarray(n, float)
    frac = (n - 1) / np.maximum(n, 1)
    if op == "all_reduce":
        t = 2 * frac * nbytes / bandwidth_Bps + 2 * (n - 1) * latency_s
    elif op == "p2p":
        t = nbytes / bandwidth_Bps + latency_s
    else:
        t = frac * nbytes / bandwidth_Bps + (n - 1) * latency_s
    return np.where(n > 1, t, 0.0) if op != "p2p" else t


def relay_copy_bytes(n, nodes, nbytes) -> np.ndarray:
    """Bytes HALO's row copies write on one rank per exchange (runtime/halo.py ``_exchange``).

    Per rank sending S bytes, g = n / nodes, R = S (n - g) / n: the gathers of phase I's rows (S g / n) and
    phase II's (R), the relay's gather of what it received (R) before phase III, and the final cat and reorder
    of the S bytes received (2 S): ``S (2 + g / n) + 2 R``, one after another on the rank."""
    n = np.asarray(n, float)
    g = n / np.maximum(np.asarray(nodes, float), 1)
    per_rank = np.asarray(nbytes, float) / np.maximum(n, 1)
    return per_rank * (2 * n + g) + 2 * per_rank * (n - g)


def calibrated_pairs(calibration) -> frozenset[tuple[str, str]]:
    """The (op, scope) pairs the calibration has collective rows for, read once."""
    if calibration is None:
        return frozenset()
    return frozenset((op.value, scope) for op in CollectiveOp for scope in SCOPES
                     if calibration.has_collective(op.value, scope))


class Network:
    """Collective times on one platform, calibrated per (op, scope) where data exists."""

    def __init__(self, platform: PlatformSpec, calibration=None):
        self.platform, self.calibration = platform, calibration
        self.bw, self.lat = scope_tables(platform)
        self.extrapolated = False
        self.calibrated_ops: set[str] = set()
        self._calibrated_pairs = calibrated_pairs(calibration)

    def _calibrated(self, op: str, scope: str) -> bool:
        return (op, scope) in self._calibrated_pairs

    def seconds(self, op: str, n, nbytes, scope):
        """Time of ``op`` over n ranks whose widest scope index is ``scope`` (arrays broadcast)."""
        n, nbytes, scope = np.broadcast_arrays(np.asarray(n, float), np.asarray(nbytes, float), np.asarray(scope))
        out = alpha_beta_seconds(op, n, nbytes, self.bw[scope], self.lat[scope])
        for i, name in enumerate(SCOPES):
            if not self._calibrated(op, name):
                continue
            out = self._overwrite(out, op, name, (scope == i) & (n > 1), n, nbytes)
        return out

    def _overwrite(self, out, op: str, scope_name: str, mask, n, nbytes, label: str | None = None):
        """``out`` with the calibrated seconds of ``op`` at ``scope_name`` where ``mask`` holds (noting the source)."""
        if not np.any(mask):
            return out
        t, extra = self.calibration.collective_seconds(op, scope_name, n[mask], nbytes[mask])
        out = out.copy()
        out[mask] = t
        self.extrapolated |= bool(np.any(extra))
        self.calibrated_ops.add(label or f"{op}@{scope_name}")
        return out

    def a2a_phases(self, n, nodes, nbytes, scope):
        """Phase times of a multi-node all-to-all: (local, remote_flat, remote_halo, redistribute).

        Alpha-beta from the platform's network figures, except where collectives.csv has ``all_to_all`` rows:
        phases I (local rows: a g-rank all-to-all of buffer S g / n) and III (redistribution: a g-rank
        all-to-all of the R remote bytes received) use the ``node`` curve; phase II (remote rows) uses the
        curve of the scope the group spans, at n ranks and the whole buffer S — a flat all-to-all of the same
        bytes, whose messages HALO only packs larger [modelling assumption: bandwidth-bound, latency saved
        not credited]. ``halo_all_to_all`` rows, when measured, replace the whole operation (a2a_seconds)."""
        n = np.asarray(n, float)
        nodes = np.maximum(np.asarray(nodes, float), 1)
        g = n / nodes
        local = nbytes * (g - 1) / np.maximum(n, 1)
        remote = nbytes * (n - g) / np.maximum(n, 1)
        bw_s, lat_s, bw_n, lat_n = self.bw[scope], self.lat[scope], self.bw[0], self.lat[0]
        peers_local, peers_remote, relays = self._latencies_paid(g - 1, n - g, nodes - 1)
        t_local = local / bw_n + peers_local * lat_n
        burst_s = self._burst_seconds()
        # flat: each pair's two directions share one connection, as a p2p (sendrecv) row measures them
        t_flat_remote = np.maximum(np.maximum(remote / bw_s - burst_s, 0.0) + peers_remote * lat_s,
                                   self._connection_seconds(nbytes / np.maximum(n, 1), scope))
        bw_halo = np.where(np.asarray(scope) == SCOPES.index("switch"), np.maximum(bw_s, self._nic_affine_Bps()), bw_s)
        t_halo_remote = np.maximum(np.maximum(remote / bw_halo - burst_s, 0.0) + relays * lat_s,
                                   self._one_way_seconds(remote / np.maximum(nodes - 1, 1), scope))
        t_redistribute = remote * (g - 1) / g / bw_n + peers_local * lat_n
        if self._calibrated("all_to_all", "node"):
            t_local = self._curve("all_to_all", "node", g, nbytes * g / np.maximum(n, 1), t_local, "HALO phase I")
            t_redistribute = self._curve("all_to_all", "node", g, remote, t_redistribute, "HALO phase III")
        if self.platform.node.nodes_share_host:   # every node's intra-node rows at once on one host
            t_local, t_redistribute = t_local * nodes, t_redistribute * nodes
        for i, name in enumerate(SCOPES[1:], start=1):
            if self._calibrated("all_to_all", name):
                at = np.broadcast_to(scope == i, np.shape(t_halo_remote))
                t_halo_remote = self._curve("all_to_all", name, n, nbytes, t_halo_remote, "HALO phase II", at)
        return t_local, t_flat_remote, t_halo_remote, t_redistribute

    def host_steps_seconds(self) -> tuple[float, float]:
        """(flat, HALO) seconds each dependent step waits for the host: a flat exchange is one step, each HALO
        phase one (node.host_step_us; node.halo_step_us for HALO's where set)."""
        node = self.platform.node
        halo_us = node.host_step_us if node.halo_step_us is None else node.halo_step_us
        return node.host_step_us * 1e-6, halo_us * 1e-6

    def _latencies_paid(self, local_peers, remote_peers, relays):
        """Latencies an exchange pays (local peers, remote peers, relays): one per peer, or one per exchange
        where the all-to-all posts every message at once (network.a2a_posts_all)."""
        if not self.platform.network.a2a_posts_all:
            return local_peers, remote_peers, relays
        return tuple(np.minimum(np.asarray(k, float), 1.0) for k in (local_peers, remote_peers, relays))

    def relay_copy_seconds(self, n, nodes, nbytes):
        """HALO's row copies on one rank (``relay_copy_bytes``) at node.relay_copy_GBps; 0 where not priced."""
        copy_bytes = relay_copy_bytes(n, nodes, nbytes)
        rate_Bps = self.platform.node.relay_copy_GBps * 1e9
        return copy_bytes / rate_Bps if rate_Bps > 0 else np.zeros_like(copy_bytes)

    def _one_way_seconds(self, nbytes, scope):
        """One connection carrying ``nbytes`` one way (HALO's phase II: each direction on its own communicator,
        runtime/halo.py ``_p2p_group``). A p2p row is a sendrecv, both ways on one connection: on a half-duplex
        network (network.half_duplex_connections) that moves 2 x its bytes in turn, so one way = the row of b / 2."""
        nbytes = np.asarray(nbytes, float)
        return self._connection_seconds(nbytes / 2 if self.platform.network.half_duplex_connections else nbytes, scope)

    def _burst_seconds(self) -> float:
        """Wire time the busiest NIC saves on an exchange that starts with its link idle: the link's burst
        (network.link_burst_bytes) at the NIC's rate, where the bandwidth terms are the NIC's rate shared out
        (remote / bw = the busiest NIC's bytes / its rate). 0 without a burst or a NIC figure."""
        burst, nic = self.platform.network.link_burst_bytes, self.platform.node.nic_bandwidth_GBps
        return burst / (nic * 1e9) if burst > 0 and nic > 0 else 0.0

    def _nic_affine_Bps(self) -> float:
        """Per-rank bandwidth when every rank sends over its own NIC: NIC bandwidth / ranks on the busiest NIC."""
        node = self.platform.node
        if node.num_nics < 1 or node.nic_bandwidth_GBps <= 0:
            return 0.0
        return node.nic_bandwidth_GBps * 1e9 / max(np.bincount(node.nic_of_device).max(), 1)

    def _connection_seconds(self, nbytes, scope):
        """Time of one connection's share: a point-to-point transfer of ``nbytes`` (calibrated ``p2p`` where
        measured, else alpha-beta at the scope)."""
        nbytes, scope = np.broadcast_arrays(np.asarray(nbytes, float), np.asarray(scope))
        return self.seconds("p2p", 2, nbytes.ravel(), scope.ravel()).reshape(nbytes.shape)

    def a2a_source(self, algo: str, ep: int, nodes: int, scope: int) -> str:
        """Where one plan's expert all-to-all time comes from: calibration rows or the platform's figures."""
        platform = "platform network figures (alpha-beta)"
        name = SCOPES[scope]
        if ep <= 1:
            return "none (ep = 1)"
        if algo == A2A.HALO and nodes > 1:
            if self._calibrated("halo_all_to_all", name):
                return f"calibration: halo_all_to_all@{name} (whole operation)"
            node = "calibration all_to_all@node" if self._calibrated("all_to_all", "node") else platform
            remote = f"calibration all_to_all@{name}" if self._calibrated("all_to_all", name) else platform
            return f"HALO phases I/III: {node}; phase II: {remote}"
        return f"calibration: all_to_all@{name}" if self._calibrated("all_to_all", name) else platform

    def _curve(self, op, scope_name, n, nbytes, fallback, phase, where=None):
        """``fallback`` with the calibrated curve's seconds where ``where`` (and n > 1); notes the source."""
        n, nbytes, out = np.broadcast_arrays(np.asarray(n, float), np.asarray(nbytes, float), np.asarray(fallback, float))
        mask = (n > 1) & (True if where is None else where)
        return self._overwrite(out, op, scope_name, mask, n, nbytes, f"{op}@{scope_name} ({phase})")

    def a2a_seconds(self, algo, n, nodes, nbytes, scope) -> tuple[np.ndarray, np.ndarray]:
        """(intra-node seconds, inter-node seconds) of one expert all-to-all; ``algo``: A2A codes.

        The split names where the time goes (``moe/dispatch/intra_node`` / ``inter_node``); their sum is the
        time of the collective."""
        n, nodes, nbytes, scope, algo = np.broadcast_arrays(np.asarray(n, float), np.asarray(nodes, float),
                                                            np.asarray(nbytes, float), np.asarray(scope),
                                                            np.asarray(algo))
        t_local, t_flat_r, t_halo_r, t_redis = self.a2a_phases(n, nodes, nbytes, scope)
        flat_step, halo_step = (step * (n > 1) for step in self.host_steps_seconds())   # no exchange, no step
        multi = (nodes > 1) & (n > 1)
        flat_hidden = self._hidden_step(flat_step, t_flat_r)
        flat_total = np.where(multi, np.maximum(t_local, t_flat_r) - flat_hidden, t_local) + flat_step
        t_flat_r = t_flat_r + flat_step - flat_hidden
        serial = self.platform.node.serial_phases
        t_local_h, t_redis = t_local + halo_step, t_redis + halo_step
        t_halo_r = t_halo_r + halo_step - self._hidden_step(halo_step, t_halo_r)
        phases = t_local_h + t_halo_r + t_redis if serial else np.maximum(t_local_h, t_halo_r + t_redis)
        halo_total = phases + np.where(multi, self.relay_copy_seconds(n, nodes, nbytes), 0)
        halo = algo == A2A.HALO.code
        total = np.where(multi & halo, halo_total, flat_total)
        total = self._calibrated_a2a(total, algo, n, nbytes, scope, multi)
        inter = np.where(multi, np.minimum(total, np.where(halo, t_halo_r, t_flat_r)), 0.0)
        return total - inter, inter

    def _hidden_step(self, step_s, wire_s):
        """Host-step seconds that run under a step's inter-node transfer (node.host_step_hidden of the shorter)."""
        hidden = self.platform.node.host_step_hidden
        return hidden * np.minimum(step_s, wire_s) if hidden > 0 else 0.0

    def _calibrated_a2a(self, total, algo, n, nbytes, scope, multi):
        halo = algo == A2A.HALO.code
        for op in (CollectiveOp.ALL_TO_ALL, CollectiveOp.HALO_ALL_TO_ALL):
            for i, name in enumerate(SCOPES):
                if not self._calibrated(op, name):
                    continue
                which = halo & multi if op == CollectiveOp.HALO_ALL_TO_ALL else ~halo | ~multi   # HALO on one node is flat
                total = self._overwrite(total, op, name, (scope == i) & (n > 1) & which, n, nbytes)
        return total
