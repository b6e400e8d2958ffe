"""Derive the Frontier SEED calibration from published measurements; rerun to regenerate the CSVs here.

    .venv/bin/python calibration/frontier/derive_seed.py

Every number below is copied from shared/reference/platforms.md ("Measured on Frontier": X-MoE lab planner
cache, one node = 8 MI250X GCDs) and turned into rows by the arithmetic written next to it. Assumptions
(marked [inferred] in each row's source) are stated once here:
- EP = 8 over the node's 8 GCDs, balanced routing: tokens per expert m = 8 x T x top_k / E, experts per GCD
  E / 8 (the grouped-GEMM ``groups``); T = seq x mbs tokens per GCD.
- QKV projection of multi-head attention [T x d] @ [d x 3d]; out-projection [T x d] @ [d x d].
- Attention core with head_dim 128 (heads = d / 128), causal; FLOPs per schema.attention_flops.
- All-to-all bytes per rank (nccl-tests ``size``) = T x top_k x d x 2 B (bf16, one copy per routed expert);
  seconds = mean of the published dispatch and combine times.
No backward attention, inter-node collective or small-message point is published: none is seeded (the cost
model falls back to platforms/frontier.yaml's link bandwidths and says so; `piper calibrate` on a node fills them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from piper_plan.calibration.io import render_csv  # noqa: E402
from piper_plan.calibration.schema import ATTENTION, COLLECTIVES, GEMM, attention_flops, busbw_factor, gemm_flops  # noqa: E402
from piper_plan.fileio import atomic_write_json, atomic_write_text  # noqa: E402

DEVICE = "AMD Instinct MI250X GCD"
CITE = "seed: platforms.md 'Measured on Frontier' (X-MoE lab planner cache, one node, 8 GCDs)"
# (label, d, E, d_ffn, top_k, seq, mbs, expert TFLOPS, (qkv, attention, out-proj) fwd ms, (dispatch, combine) fwd ms)
CONFIGS = (
    ("d2048 E64 dffn1408 k6 s2048 mbs1", 2048, 64, 1408, 6, 2048, 1, 43.0, (0.73, 0.85, 0.30), (0.65, 0.68)),
    ("d5120 E128 dffn1536 k6 s4096 mbs1", 5120, 128, 1536, 6, 4096, 1, 95.0, (6.41, 3.79, 2.10), (1.89, 2.23)),
    ("d7168 E256 dffn2048 k8 s4096 mbs2", 7168, 256, 2048, 8, 4096, 2, 120.0, (23.07, 11.35, 7.42), (6.72, 6.82)),
)
GCDS = 8


def gemm_row(m, n, k, groups, seconds, source):
    return {"device": DEVICE, "dtype": "bf16", "m": m, "n": n, "k": k, "groups": groups, "seconds": seconds,
            "tflops": gemm_flops(m, n, k, groups) / seconds / 1e12, "source": source}


def gemm_rows(cfg) -> list[dict]:
    label, d, e, dffn, topk, seq, mbs, tflops, (qkv_ms, _, out_ms), _ = cfg
    tokens = seq * mbs
    m, groups = GCDS * tokens * topk // e, e // GCDS
    why = f"{CITE}: {label}"
    rows = []
    for n, k, which in ((dffn, d, "up"), (d, dffn, "down")):
        seconds = gemm_flops(m, n, k, groups) / (tflops * 1e12)
        rows.append(gemm_row(m, n, k, groups, seconds,
                             f"{why}: expert GEMMs ~{tflops:g} TFLOPS per layer; [inferred] {which}-projection shape, "
                             f"m = 8 x {tokens} x {topk} / {e} tokens per expert, {groups} experts per GCD"))
    rows.append(gemm_row(tokens, 3 * d, d, 1, qkv_ms * 1e-3,
                         f"{why}: QKV forward {qkv_ms} ms; [inferred] MHA [T x d] @ [d x 3d], T = {tokens}"))
    rows.append(gemm_row(tokens, d, d, 1, out_ms * 1e-3,
                         f"{why}: out-projection forward {out_ms} ms; [inferred] [T x d] @ [d x d], T = {tokens}"))
    return rows


def attention_row(cfg) -> dict:
    label, d, _, _, _, seq, mbs, _, (_, attn_ms, _), _ = cfg
    heads, seconds = d // 128, attn_ms * 1e-3
    flops = float(attention_flops(mbs, seq, heads, 128, True, "fwd"))
    return {"device": DEVICE, "dtype": "bf16", "pass": "fwd", "batch": mbs, "seq_len": seq, "num_heads": heads,
            "num_kv_heads": heads, "head_dim": 128, "causal": True, "seconds": seconds, "tflops": flops / seconds / 1e12,
            "source": f"{CITE}: {label}: attention forward {attn_ms} ms; [inferred] causal, head_dim 128, {heads} heads"}


def all_to_all_row(cfg) -> dict:
    label, d, _, _, topk, seq, mbs, _, _, (disp_ms, comb_ms) = cfg
    size = seq * mbs * topk * d * 2
    seconds = (disp_ms + comb_ms) / 2 * 1e-3
    algbw = size / seconds / 1e9
    return {"op": "all_to_all", "scope": "node", "num_nodes": 1, "ranks_per_node": GCDS, "bytes_per_rank": size,
            "seconds": seconds, "algbw_GBps": algbw, "busbw_GBps": algbw * busbw_factor("all_to_all", GCDS),
            "source": f"{CITE}: {label}: forward all-to-all dispatch {disp_ms} / combine {comb_ms} ms (mean used); "
                      f"[inferred] size = {seq * mbs} tokens x top-{topk} x d {d} x 2 B (bf16)"}


def main() -> None:
    here = Path(__file__).resolve().parent
    tables = {GEMM: [r for c in CONFIGS for r in gemm_rows(c)], ATTENTION: [attention_row(c) for c in CONFIGS],
              COLLECTIVES: [all_to_all_row(c) for c in CONFIGS]}
    for table, rows in tables.items():
        frame = pd.DataFrame(rows, columns=table.column_names).sort_values(list(table.key))
        atomic_write_text(here / table.filename, render_csv(frame, table))
    atomic_write_json(here / "metadata.json", {
        "platform": "frontier", "kind": "seed", "device": {"name": DEVICE, "kind": "seed"},
        "command": "python calibration/frontier/derive_seed.py",
        "sources": ["shared/reference/platforms.md, 'Measured on Frontier' (X-MoE lab planner cache: per-layer "
                    "expert GEMM TFLOPS, QKV / attention / out-projection and all-to-all forward times, one node)",
                    "assumptions: see the docstring of derive_seed.py and each row's source"],
        "note": "Seed data: what a user has before running `piper calibrate` on a Frontier node, which replaces it."})


if __name__ == "__main__":
    main()
