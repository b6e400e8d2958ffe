"""``piper reproduce``: the Piper paper's tables as the resource model sees them, each beside the paper's number.

Pure computation and Markdown rendering (strings); the CLI writes the files. Every table is a list of row dicts
(plain numbers) so tests can assert on numbers. Paper numbers: shared/reference/piper-paper.md (Dash & Wang 2026,
arXiv:2605.05049, as reproduced by a public technical review).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GiB = 2**30
HALO_NODES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
HALO_SIZES_BYTES = (1 << 20, 16 << 20, 256 << 20)        # all-to-all send buffer per rank (nccl-tests ``size``)
PAPER_HALO = "1.2-9x over RCCL all_to_all at 16+ nodes; about parity inside one switch group (4 nodes)"

# Single MoE layer on one node (8 GCDs), TFLOPS per GCD (piper-paper.md, Results)
PAPER_SINGLE_LAYER = {"mixtral-8x22b": 129.4, "mixtral-8x7b": 117.5, "llama4-maverick": 112.4, "llama4-scout": 109.6,
                      "arctic": 104.2, "deepseek-v3": 84.3, "kimi-k2": 81.7, "deepseek-v2": 78.3}
# Full models, sequence 4096: (TFLOPS per GCD, MFU, activation checkpointing)
PAPER_FULL_MODEL = {"mixtral-8x7b": (102.8, 0.538, False), "mixtral-8x22b": (55.4, 0.290, True),
                    "llama4-scout": (74.2, 0.388, False), "llama4-maverick": (37.8, 0.198, True),
                    "deepseek-v2": (46.8, 0.245, True)}
# X-MoE's TFLOPS per GCD on the same models (piper-paper.md, "Against MoE frameworks")
PAPER_XMOE = {"xmoe-small": 44.0, "xmoe-medium": 24.20, "xmoe-large": 24.10, "xmoe-super": 10.20}
PAPER_WEAK_EFFICIENCY = 0.73      # 64 -> 1024 GPUs (33.04 / 45.15)


@dataclass
class Table:
    """A titled table: columns and rows of plain values; notes printed under it."""

    title: str
    columns: list[str]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns) + "\n"
        body = "".join("| " + " | ".join(_cell(r.get(c)) for c in self.columns) + " |\n" for r in self.rows)
        notes = "".join(f"\n{n}\n" for n in self.notes)
        return f"## {self.title}\n\n{head}{body}{notes}"


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _diff_pct(predicted, paper) -> float | None:
    return None if predicted is None or not paper else 100.0 * (predicted - paper) / paper


# ---- HALO vs flat ------------------------------------------------------------------------------------
def halo_rows(platform, calibration=None, nodes=HALO_NODES, sizes=HALO_SIZES_BYTES) -> list[dict]:
    """Modelled flat and HALO all-to-all seconds over all ranks of ``nodes`` compact nodes (cost.comm)."""
    from piper_plan.cost.comm import Network
    from piper_plan.placement.layout import allocation, group_span

    net = Network(platform, calibration)
    rows = []
    for n_nodes in (n for n in nodes if n <= platform.node_limit):      # no row the platform cannot allocate
        alloc = allocation(platform, n_nodes, "compact")
        ranks = n_nodes * platform.devices_per_node
        span = group_span(alloc, 1, ranks)
        for size in sizes:
            flat = sum(net.a2a_seconds(0, ranks, span.nodes, size, span.scope_index))
            halo = sum(net.a2a_seconds(1, ranks, span.nodes, size, span.scope_index))
            rows.append({"nodes": n_nodes, "ranks": ranks, "scope": span.scope, "size_MiB": size / 2**20,
                         "flat_ms": float(flat) * 1e3, "halo_ms": float(halo) * 1e3,
                         "speedup": float(flat / halo)})
    return rows


def halo_table(platform, calibration=None) -> Table:
    """Without calibration by default: the seed rows cover one node at three large sizes only, and mixing a
    clamped calibrated curve (1 node) with alpha-beta (2+ nodes) would make the node-count trend meaningless."""
    rows = halo_rows(platform, calibration)
    return Table(f"HALO vs flat all-to-all on {platform.name} (modelled)",
                 ["nodes", "ranks", "scope", "size_MiB", "flat_ms", "halo_ms", "speedup"], rows,
                 [f"Paper: {PAPER_HALO}. size = bytes each rank sends in total (nccl-tests `size`)."])


# ---- feasibility map ---------------------------------------------------------------------------------
def paper_stage0_bytes(model, seq_len: int, mbs: int, pp: int, ep: int) -> float:
    """The paper's M(0) for 1F1B (16 B/param, MHA, no embeddings; 3-matrix experts as the paper assumes):
    (L/PP) [64 d^2 + (48E/EP) d d_ffn + PP (12 b s d + 4 b H s^2 + (2 b s k / EP)(3 d_ffn + d))], b = mbs."""
    d, s, b = model.hidden_size, seq_len, mbs
    moe = model.moe
    E, k, f = moe.num_experts, moe.top_k, moe.expert.intermediate_size
    H = model.attention.num_heads
    act = 12 * b * s * d + 4 * b * H * s * s + 2 * b * s * k / ep * (3 * f + d)
    return model.num_layers / pp * (64 * d * d + 48 * E / ep * d * f + pp * act)


def feasibility_rows(model, platform, nodes: int, seq_len: int = 4096, mbs: int = 1) -> list[dict]:
    """Stage-0 memory per GCD for every PP x EP = world (piper strategy: dp = ep, tp = 1, 1F1B, no recompute)."""
    from piper_plan.cost.evaluate import estimate
    from piper_plan.specs import ParallelPlan, TrainingSpec

    world = nodes * platform.devices_per_node
    training = TrainingSpec(seq_len=seq_len, global_batch=world * mbs * 4)
    limit = platform.device.memory_bytes
    rows = []
    for pp in (p for p in range(1, world + 1) if world % p == 0 and p <= model.num_layers):
        ep = world // pp
        if model.moe.num_experts % ep:
            continue
        plan = ParallelPlan(dp=ep, ep=ep, pp=pp, mbs=mbs, num_microbatches=training.global_batch // (ep * mbs))
        ours = estimate(model, platform, training, nodes, plan).memory.per_stage[0].total_bytes
        full = estimate(model, platform, training, nodes, plan.model_copy(update={"recompute": "full"}))
        full = full.memory.per_stage[0].total_bytes
        paper = paper_stage0_bytes(model, seq_len, mbs, pp, ep)
        rows.append({"PP": pp, "EP": ep, "paper_eq_GiB": paper / GiB, "piper_GiB": ours / GiB,
                     "paper_fits": paper <= limit, "piper_fits": ours <= limit,
                     "piper_full_recompute_GiB": full / GiB, "full_recompute_fits": full <= limit})
    return rows


def feasibility_table(model, platform, nodes: int) -> Table:
    rows = feasibility_rows(model, platform, nodes)
    return Table(f"Feasibility map: {model.name} on {nodes} nodes ({nodes * platform.devices_per_node} GCDs), "
                 f"stage-0 memory per GCD vs the {platform.device.memory_bytes / GiB:.0f} GiB line",
                 ["PP", "EP", "paper_eq_GiB", "piper_GiB", "paper_fits", "piper_fits", "piper_full_recompute_GiB",
                  "full_recompute_fits"], rows,
                 ["paper_eq: the paper's M(0) (16 B/param, 1F1B, mbs 1, no embeddings, no overheads). piper: the "
                  "resource model (embeddings, router, 2-matrix experts where the model has them, framework and "
                  "fragmentation overheads included)."])


# ---- searched tables ---------------------------------------------------------------------------------
def _search_best(model, platform, training, nodes, calibration, **options):
    from piper_plan.search.engine import search
    from piper_plan.search.space import SearchOptions

    r = search(model, platform, training, nodes, SearchOptions(strategy="piper", **options), calibration=calibration)
    return r.row(r.best) if r.feasible else None


def _plan_text(best: dict | None) -> str:
    if best is None:
        return "none fits"
    return (f"pp{best['pp']} ep{best['ep']} mbs{best['mbs']} {best['schedule']} rc={best['recompute']} "
            f"{best['a2a']}")


def single_layer_rows(platform, calibration=None) -> list[dict]:
    """One MoE layer on one node: the best plan's TFLOPS per GCD (no embedding, no LM head)."""
    from piper_plan.catalog import load_model
    from piper_plan.specs import ModelSpec, TrainingSpec

    rows = []
    for name, paper in PAPER_SINGLE_LAYER.items():
        base = load_model(name)
        data = base.model_dump()
        data.update(num_layers=1, vocab_size=None, mtp_layers=0, name=f"{name}-1layer")   # no embedding, head or MTP
        data["moe"]["layers"] = {"explicit": [0]}     # the one layer is MoE (Llama 4 interleaves dense ones)
        model = ModelSpec.model_validate(data)
        best = _search_best(model, platform, TrainingSpec(seq_len=4096, global_batch=64), 1, calibration)
        ours = best["tflops_per_device"] if best else None
        rows.append({"model": name, "paper_TFLOPS": paper, "piper_TFLOPS": ours,
                     "diff_pct": _diff_pct(ours, paper), "plan": _plan_text(best)})
    return rows


def full_model_rows(platform, calibration=None) -> list[dict]:
    """Full models, sequence 4096: the best plan at the smallest node count that fits (GPU counts unpublished)."""
    from piper_plan.catalog import load_model
    from piper_plan.search.engine import min_nodes
    from piper_plan.search.space import SearchOptions
    from piper_plan.specs import TrainingSpec

    rows = []
    for name, (paper_tflops, paper_mfu, ckpt) in PAPER_FULL_MODEL.items():
        model = load_model(name)
        opts = SearchOptions(strategy="piper", recompute=("full",) if ckpt else ("none",))
        nodes, result = min_nodes(model, platform, TrainingSpec(seq_len=4096, global_batch=1024), opts,
                                  calibration=calibration)
        best = result.row(result.best) if result else None
        ours = best["tflops_per_device"] if best else None
        rows.append({"model": name, "checkpointing": ckpt, "nodes": nodes, "paper_TFLOPS": paper_tflops,
                     "piper_TFLOPS": ours, "diff_pct": _diff_pct(ours, paper_tflops), "paper_MFU": paper_mfu,
                     "piper_MFU": best["mfu"] if best else None, "plan": _plan_text(best)})
    return rows


def validation_rows(dataset: str) -> list[dict]:
    """Rows of a validation dataset: id, published, predicted, difference in percent, plan."""
    from piper_plan.validation import validate

    (result,) = validate([dataset])
    out = []
    for r in result.rows:
        plan = r.detail.get("plan")
        out.append({"id": r.id, "quantity": r.quantity, "paper": r.published, "piper": r.predicted,
                    "diff_pct": None if r.rel_error is None else 100 * r.rel_error,
                    "plan": _plan_text(plan) if plan else "-"})
    return out


def xmoe_table(frontier_rows: list[dict]) -> Table:
    rows = []
    for r in frontier_rows:
        if r["id"] not in PAPER_XMOE:
            continue
        xmoe = PAPER_XMOE[r["id"]]
        rows.append({"model": r["id"], "X-MoE": xmoe, "paper_Piper": r["paper"], "piper_model": r["piper"],
                     "diff_pct": r["diff_pct"], "paper_ratio": r["paper"] / xmoe,
                     "model_ratio": None if r["piper"] is None else r["piper"] / xmoe, "plan": r["plan"]})
    return Table("X-MoE comparison: TFLOPS per GCD (Piper on 8 / 32 / 80 / 512 GCDs)",
                 ["model", "X-MoE", "paper_Piper", "piper_model", "diff_pct", "paper_ratio", "model_ratio", "plan"],
                 rows, ["Paper claim: 1.95-3.62x X-MoE. Assumptions as in validation/piper-frontier-moe.yaml."])


def weak_scaling_table(frontier_rows: list[dict]) -> Table:
    rows = [r for r in frontier_rows if r["id"].startswith("weak-")]
    base_paper, base_ours = rows[0]["paper"], rows[0]["piper"]
    out = []
    for r in rows:
        out.append({"model": r["id"], "paper_TFLOPS": r["paper"], "piper_TFLOPS": r["piper"], "diff_pct": r["diff_pct"],
                    "paper_efficiency": r["paper"] / base_paper,
                    "piper_efficiency": None if r["piper"] is None or not base_ours else r["piper"] / base_ours,
                    "plan": r["plan"]})
    return Table("Weak scaling (8 / 64 / 128 nodes) and efficiency vs 64 GCDs",
                 ["model", "paper_TFLOPS", "piper_TFLOPS", "diff_pct", "paper_efficiency", "piper_efficiency", "plan"],
                 out, [f"Paper: {PAPER_WEAK_EFFICIENCY:.0%} weak-scaling efficiency 64 -> 1024 GPUs."])


def migration_table(rows: list[dict]) -> Table:
    return Table("Migration Table IV: bytes per GPU and time to reassign one layer",
                 ["id", "quantity", "paper", "piper", "diff_pct"], rows,
                 ["48 E d d_ffn / 8 bytes at 50 GB/s; see validation/piper-migration-table4.yaml for the units."])


def paper_tables(platform, calibration=None) -> list[Table]:
    """Every table of the paper the model can speak to, in the paper's order."""
    from piper_plan.catalog import load_model

    frontier = validation_rows("piper-frontier-moe")
    return [
        feasibility_table(load_model("piper-weak-1.7t"), platform, 128),
        feasibility_table(load_model("mixtral-8x7b"), platform, 2),
        Table("Single MoE layer on one node (8 GCDs): TFLOPS per GCD, an upper bound",
              ["model", "paper_TFLOPS", "piper_TFLOPS", "diff_pct", "plan"], single_layer_rows(platform, calibration)),
        Table("Full models, sequence 4096: TFLOPS per GCD and MFU",
              ["model", "checkpointing", "nodes", "paper_TFLOPS", "piper_TFLOPS", "diff_pct", "paper_MFU", "piper_MFU",
               "plan"], full_model_rows(platform, calibration),
              ["GPU counts are not published: piper uses the smallest node count with a feasible plan."]),
        xmoe_table(frontier),
        weak_scaling_table(frontier),
        halo_table(platform),
        migration_table(validation_rows("piper-migration-table4")),
    ]


def render_markdown(title: str, intro: str, tables: list[Table]) -> str:
    return f"# {title}\n\n{intro}\n\n" + "\n".join(t.markdown() for t in tables)


def have_matplotlib() -> bool:
    from importlib.util import find_spec

    return find_spec("matplotlib") is not None


def plot_halo(rows: list[dict], path) -> None:
    """Speedup of HALO over flat vs nodes, one line per message size (needs the ``plot`` extra)."""
    from piper_plan.plots import pyplot, save_png

    fig, ax = pyplot().subplots(figsize=(6, 4))
    for size in sorted({r["size_MiB"] for r in rows}):
        pts = [r for r in rows if r["size_MiB"] == size]
        ax.plot([r["nodes"] for r in pts], [r["speedup"] for r in pts], marker="o", label=f"{size:g} MiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("flat / HALO time")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


def speedup_at(rows: list[dict], nodes: int) -> np.ndarray:
    return np.array([r["speedup"] for r in rows if r["nodes"] == nodes])


def _span(speedups: list[float]) -> str:
    """'a-bx' over a claim's rows, or that the platform has none (fewer nodes than the claim speaks of)."""
    if not speedups:
        return "no row (the platform has fewer nodes)"
    low, high = min(speedups), max(speedups)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def halo_analysis(rows: list[dict]) -> str:
    """The comparison with the paper, with this table's own numbers filled in."""
    big = [r["speedup"] for r in rows if r["nodes"] >= 16]
    switch = [r["speedup"] for r in rows if 1 < r["nodes"] <= 4]
    one = [r["speedup"] for r in rows if r["nodes"] == 1]
    large_msg = [r["speedup"] for r in rows if r["nodes"] >= 16 and r["size_MiB"] >= 256]
    return f"""## Comparison with the paper

| claim (paper) | model |
|---|---|
| 1.2-9x over RCCL at 16+ nodes | {_span(big)} at 16-512 nodes (all sizes); {_span(large_msg)} at 256 MiB |
| about parity inside one switch group (<= 4 nodes) | {_span(switch)} at 2-4 nodes; {_span(one)} on one node (HALO is flat there) |

Why the model agrees and where it does not:

- **Where HALO wins in the model: latency.** The model (piper_plan/cost/comm.py) gives flat all-to-all one message
  per remote peer (n - g latencies of the widest scope) and HALO one aggregated message per remote node
  (nodes - 1). Small and medium messages at many nodes are latency-bound, so the speedup grows with the node
  count and shrinks with the message size: that reproduces the paper's trend and its 9x end only for small messages.
- **Where the model is more pessimistic than the paper: bandwidth.** On Frontier a NIC-affine exchange gets no more
  per-rank bandwidth than the scope's figure (one 25 GB/s NIC per 2 GCDs either way), and piper's HALO runs the
  relay copy (phase III) after phase II (runtime/halo.py), so a bandwidth-bound exchange (256 MiB) gains little or
  loses ({_span(large_msg)}). Where flat uses the NICs unevenly, HALO's phase II gets the NICs' full
  rate: measured on an emulated network in docs/halo-measured.md.
  The paper's gains at large sizes come from effects the alpha-beta model does not price: RCCL's flat all-to-all
  does not keep all 4 NICs of a node busy nor respect GCD-NIC affinity, and congestion on the dragonfly's global
  links under n^2 small flows; HALO's aggregation reduces flow count. Calibrating `halo_all_to_all` and
  `all_to_all` rows at `group` / `system` scope on Frontier (`piper bench a2a` under srun) would replace the
  alpha-beta curves with measured ones; none are published, so none are seeded.
- **Inside one switch group** the model shows a latency gain at 1 MiB on 4 nodes (fewer messages) and a loss of
  about a fifth at large sizes (the relay copy after phase II), where the paper reports about parity.
- **One node:** the table uses no calibration by default (`--calibration` to use it); the seeded Frontier rows
  cover one node at three large sizes only, and clamping below them would distort the node-count trend.
"""
