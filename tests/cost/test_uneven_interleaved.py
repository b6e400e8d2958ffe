"""Interleaved schedules whose model chunks hold unequal layer counts (issue 17): Megatron-Core's split, the
bubble with the slowest chunk, the warm-up memory, the even case unchanged, bad settings in one line."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from piper_plan.catalog import load_model, load_platform
from piper_plan.cli.main import cli
from piper_plan.cost.evaluate import estimate
from piper_plan.cost.pipeline import rank_chunk_table, uneven_bubble_seconds
from piper_plan.plans import PlanBatch, problems
from piper_plan.specs import ParallelPlan, TrainingSpec
from piper_plan.specs.parallel import interleaved_chunk_split, layout_decoder_counts, rank_layers

H100 = load_platform("dgx-h100")


def megatron_chunks(num_layers, pp, vp, embedding, loss):
    """Megatron-Core's get_num_layers_to_build / get_transformer_layer_offset (NVIDIA/Megatron-LM 00caa53,
    transformer_block.py, transformer_layer.py) with account_for_embedding / _loss_in_pipeline_split, written out:
    {(rank, virtual stage): (offset, layers)}."""
    total = num_layers + embedding + loss
    assert total % pp == 0 and (total // pp) % vp == 0
    per_chunk = total // pp // vp
    out = {}
    for r in range(pp):
        for v in range(vp):
            build = per_chunk - (embedding if (r, v) == (0, 0) else 0) - (loss if (r, v) == (pp - 1, vp - 1) else 0)
            offset = v * (total // vp) + r * per_chunk - (embedding if (r, v) != (0, 0) else 0)
            out[r, v] = (offset, build)
    return out


@pytest.mark.parametrize("num_layers, pp, vp, embedding, loss", [
    (94, 8, 4, 1, 1), (94, 8, 3, 1, 1), (94, 8, 2, 1, 1),      # Qwen3-235B rows (both accounted)
    (30, 4, 4, 1, 1), (31, 4, 2, 0, 1), (48, 2, 24, 0, 0)])     # 31: the loss alone; 48: Qwen3-30B, equal
def test_split_rule_is_megatrons(num_layers, pp, vp, embedding, loss):
    """Chunk k of the rule (virtual-stage order) holds Megatron's layers of (rank k % pp, stage k // pp), at
    Megatron's layer offset (the chunks are consecutive in layer order)."""
    chunks = interleaved_chunk_split(num_layers, pp, vp)
    reference = megatron_chunks(num_layers, pp, vp, embedding, loss)
    starts = np.concatenate([[0], np.cumsum(chunks)])
    for k, layers in enumerate(chunks):
        assert reference[k % pp, k // pp] == (starts[k], layers), k
    assert sum(chunks) == num_layers


def test_deepseek_v3_layouts():
    """61 layers do not split by rule at pp 8 / 4 x vp 4; the presets' layouts do (Megatron-Bridge DeepSeek-V3
    H100 preset "Et|(tt|)*30mL"; the recipe's (4, 4) entry [E t*4] [t*4] x 14 [t m L]; Megatron's doc example)."""
    assert interleaved_chunk_split(61, 8, 4) is None and interleaved_chunk_split(61, 4, 4) is None
    h100 = layout_decoder_counts("Et|(tt|)*30mL")
    assert len(h100) == 32 and h100[0] == 1 and h100[-1] == 0 and rank_layers(h100, 8) == [7, 8, 8, 8, 8, 8, 8, 6]
    assert layout_decoder_counts("Et*4|(t*4|)*14tmL") == [4] * 15 + [1]
    doc = layout_decoder_counts("Et*3|(tt|)*29,m|L")
    assert len(doc) == 32 and doc[:2] == [3, 2] and doc[-2:] == [0, 0] and sum(doc) == 61


def test_warmup_memory_hand_count():
    """Qwen3-235B pp 8 vp 4 (chunks 2,3,...,3,2): rank 0 runs 7 x 2 + 3 x 8 + 1 = 39 forwards before its first
    backward, chunk (j // 8) % 4 for the j-th: 8 x 2 + 24 x 3 + 7 x 2 = 102 layers in flight; rank 7 (chunks
    3,3,3,2) runs 25: 24 x 3 + 1 x 2 = 74."""
    model = load_model("qwen3-235b-a22b")
    table = rank_chunk_table(model, interleaved_chunk_split(94, 8, 4), 8)
    assert list(table["layers"]) == [11, 12, 12, 12, 12, 12, 12, 11]
    assert table["flight_layers"][0] == 102 and table["flight_layers"][7] == 74


def _qwen_estimate(**parallel):
    model = load_model("qwen3-235b-a22b")
    training = TrainingSpec(seq_len=4096, global_batch=2048)
    plan = ParallelPlan(tp=2, pp=8, dp=16, ep=32, num_microbatches=128, zero=1, schedule="interleaved",
                        **parallel)
    assert problems(model, H100, training, 32, PlanBatch.of(plan)) == [None]
    return estimate(model, H100, training, 32, plan)


def test_bubble_is_slowest_chunk_hand_count():
    """All 94 layers are MoE: a middle rank is 12 layer-times t, the last 11 t + the LM head h. Chunks: 3 t
    (most), 2 t (the first), 2 t + h (the last). Bubble = 7 x (max(3 t, 2 t + h) + p2p / 4)."""
    result = _qwen_estimate(virtual_stages=4)
    assert result.layers_per_stage == [11, 12, 12, 12, 12, 12, 12, 11]
    p2p = result.time.breakdown["pipeline/p2p"] / 128
    stage = [s.time_per_microbatch_s - p2p for s in result.memory.per_stage]
    t = stage[3] / 12
    head = stage[7] - 11 * t
    expected = 7 * (max(3 * t, 2 * t + head) + p2p / 4)
    assert result.time.breakdown["pipeline/bubble"] == pytest.approx(expected, rel=1e-9)
    assert uneven_bubble_seconds(1.0, 0.0, 4, 2) == 3.0      # equal chunks of t / v = 1: (pp - 1) x t / v


def test_even_case_unchanged():
    """Equal chunks stated explicitly price bit-identically to the rule's; the bubble is (pp - 1) / v of a
    micro-batch (Qwen3-235B at pp 2 x vp 47: 94 = 2 x 47 equal chunks of 1)."""
    model = load_model("qwen3-235b-a22b")
    training = TrainingSpec(seq_len=4096, global_batch=2048)
    base = dict(tp=2, pp=2, dp=64, ep=32, num_microbatches=32, zero=1, schedule="interleaved", virtual_stages=47)
    ruled = estimate(model, H100, training, 32, ParallelPlan(**base))
    stated = estimate(model, H100, training, 32, ParallelPlan(**base, virtual_stage_layers=[1] * 94))
    assert ruled.time.breakdown == stated.time.breakdown and ruled.memory.peak_bytes == stated.memory.peak_bytes
    t_mb = max(s.time_per_microbatch_s for s in ruled.memory.per_stage)
    assert ruled.time.breakdown["pipeline/bubble"] == pytest.approx(t_mb * 1 / 47, rel=1e-12)


def test_unequal_chunks_price_between_equal_bounds():
    """vp 4 on 94 layers: a smaller bubble than 1F1B's on the same split, a larger one than equal chunks'."""
    interleaved = _qwen_estimate(virtual_stages=4)
    t_mb = max(s.time_per_microbatch_s for s in interleaved.memory.per_stage)
    bubble = interleaved.time.breakdown["pipeline/bubble"]
    assert t_mb * 7 / 4 <= bubble < t_mb * 7


def _run(args):
    return CliRunner().invoke(cli, args)


def test_bad_settings_one_line(tmp_path):
    """A chunk list that does not sum, a layout with an unknown layer letter, an uneven vp without a list:
    one error line each, exit 2."""
    base = ["estimate", "--model", "deepseek-v3", "--platform", "dgx-h100", "--nodes", "128", "--tp", "2",
            "--pp", "8", "--dp", "64", "--ep", "64", "--global-batch", "8192", "--schedule", "interleaved",
            "--virtual-stages", "4"]
    for extra, needle in ((["--virtual-stage-layers", "1,2,3"], "virtual_stage_layers_invalid"),
                          (["--virtual-stage-layers", "Ex|t"], "unknown characters"),
                          ([], "interleaved_layers_not_divisible")):
        result = _run(base + extra)
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.output
    ok = _run(base + ["--virtual-stage-layers", "Et|(tt|)*30mL", "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["layers_per_stage"] == [7, 8, 8, 8, 8, 8, 8, 6]


def test_launch_refuses_unequal_chunks(tmp_path):
    """The runtime builds equal chunks only: `launch --plan` refuses a saved plan with unequal ones in one line."""
    path = tmp_path / "plan.json"
    saved = _run(["estimate", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "2", "--dp", "2",
                  "--pp", "2", "--ep", "2", "--global-batch", "8", "--seq", "64", "--schedule", "interleaved",
                  "--virtual-stages", "2", "--virtual-stage-layers", "1,2,0,1", "-o", str(path)])
    assert saved.exit_code == 0, saved.output
    assert json.loads(path.read_text())["parallel"]["layers_per_stage"] == [1, 3]
    result = _run(["launch", "--plan", str(path), "--out-dir", str(tmp_path / "job")])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "unequal layers" in lines[0], result.output


def test_search_enumerates_unequal_chunks():
    """Qwen3-235B on 32 H100 nodes: the search now keeps interleaved plans at pp 8 (94 + 2 = 96 = 8 x 2 x 6)."""
    from piper_plan.search.space import enumerate_space

    model, training = load_model("qwen3-235b-a22b"), TrainingSpec(seq_len=4096, global_batch=2048)
    space = enumerate_space(model, H100, training, 32)
    f = space.fields
    assert np.any((f["schedule"] == 2) & (f["pp"] == 8))


def test_megatron_export_states_the_layout(tmp_path):
    """An exported plan with unequal chunks carries them as Megatron-Core's --pipeline-model-parallel-layout
    (which reads back to the same chunks), not first / last stage counts Megatron would refuse with vp."""
    path = tmp_path / "plan.json"
    saved = _run(["estimate", "--model", "qwen3-235b-a22b", "--platform", "dgx-h100", "--nodes", "32", "--tp", "2",
                  "--pp", "8", "--dp", "16", "--ep", "32", "--global-batch", "2048", "--schedule", "interleaved",
                  "--virtual-stages", "4", "-o", str(path)])
    assert saved.exit_code == 0, saved.output
    result = _run(["export", str(path), "--engine", "megatron"])
    assert result.exit_code == 0, result.output
    line = next(part for part in result.stdout.split("\n") if "--pipeline-model-parallel-layout" in part)
    layout = line.split("--pipeline-model-parallel-layout")[1].split()[0].strip("'\"")
    assert layout_decoder_counts(layout) == interleaved_chunk_split(94, 8, 4)
    assert "--decoder-first-pipeline-num-layers" not in result.stdout
    assert "--num-virtual-stages-per-pipeline-rank" not in result.stdout     # Megatron takes one of the two


def _megatron_order(pp, v, m, r):
    """Rank r's (kind, micro-batch, virtual stage) order in Megatron-Core's interleaved 1F1B
    (schedules.py forward_backward_pipelining_with_interleaving: (pp - r - 1) x 2 + (v - 1) x pp warm-up forwards,
    then one forward and one backward, then the remaining backwards; virtual micro-batch k runs model chunk
    (k // pp) % v, backward chunks in reverse)."""
    total = m * v
    warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
    ids = [("f", k) for k in range(warm)]
    for i in range(total - warm):
        ids += [("f", warm + i), ("b", i)]
    ids += [("b", k) for k in range(total - warm, total)]
    out = []
    for kind, k in ids:
        chunk = (k // pp) % v
        out.append((kind, (k // (pp * v)) * pp + k % pp, v - 1 - chunk if kind == "b" else chunk))
    return out


def _simulated_step(forward, pp, v, m):
    """Makespan of that order with forward[r][vs] seconds per chunk forward and twice that backward, each op
    starting when its rank is free and its input (the previous chunk's forward, the next one's backward) is done."""
    orders = [_megatron_order(pp, v, m, r) for r in range(pp)]
    done, free, pos = {}, [0.0] * pp, [0] * pp
    while any(p < len(o) for p, o in zip(pos, orders)):
        moved = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, mb, vs = orders[r][pos[r]]
            if kind == "f":
                prev = (r - 1, vs) if r > 0 else (pp - 1, vs - 1)
                need = ("f", mb, *prev) if (r, vs) != (0, 0) else None
            else:
                nxt = (r + 1, vs) if r < pp - 1 else (0, vs + 1)
                need = ("b", mb, *nxt) if (r, vs) != (pp - 1, v - 1) else ("f", mb, r, vs)
            if need is not None and need not in done:
                continue
            free[r] = max(free[r], done.get(need, 0.0)) + forward[r][vs] * (1 if kind == "f" else 2)
            done[(kind, mb, r, vs)] = free[r]
            pos[r] += 1
            moved = True
        assert moved
    return max(free)


@pytest.mark.parametrize("pp, v, m, chunks", [
    (4, 2, 8, [1.0] * 8), (4, 2, 8, [1, 2, 2, 2, 2, 2, 2, 1]), (4, 2, 8, [2, 2, 2, 2, 2, 2, 2, 0.5]),
    (8, 4, 16, [1] + [2] * 30 + [2.5]), (8, 4, 16, [2] + [3] * 30 + [2.4]), (8, 3, 16, [3] + [4] * 22 + [5])])
def test_bubble_against_megatrons_schedule(pp, v, m, chunks):
    """Priced step (M x the busiest rank + the bubble of pp - 1 slowest-chunk slots) against a simulation of
    Megatron-Core's interleaved order: equal for equal chunks, an upper bound within one bubble otherwise."""
    forward = [[chunks[vs * pp + r] for vs in range(v)] for r in range(pp)]
    busiest = max(3 * sum(row) for row in forward)
    priced = m * busiest + uneven_bubble_seconds(3 * max(chunks), 0.0, pp, v)
    simulated = _simulated_step(forward, pp, v, m)
    if len(set(chunks)) == 1:
        assert simulated == pytest.approx(priced, rel=1e-12)
    else:
        assert m * busiest <= simulated <= priced
    print(f"pp {pp} v {v} M {m}: simulated {simulated:g}, priced {priced:g} ({priced / simulated - 1:+.1%})")


def test_a_layout_that_repeats_without_bound_is_refused_before_it_is_built():
    """'t*100000000000' would build a 100 GB string: refused in one line, as is a negative count."""
    base = ["estimate", "--model", "deepseek-v3", "--platform", "frontier", "--nodes", "8", "--pp", "4", "--dp", "16",
            "--ep", "8", "--schedule", "interleaved", "--virtual-stages", "2", "--virtual-stage-layers"]
    for value, needle in (("t*100000000000", "expand past"), ("(t*99|)*99999", "expand past"),
                          ("1,1,-1,3", "greater than or equal to 0")):
        done = CliRunner().invoke(cli, base + [value])
        assert done.exit_code == 2 and needle in done.output and "Traceback" not in done.output, done.output
