"""The single-process reference: the whole model on one rank, the same global batch and micro-batch chunks."""

from __future__ import annotations

import torch

from piper_plan.runtime.data import dp_slice, make_source
from piper_plan.runtime.model import StageModel, init_stage
from piper_plan.runtime.pipeline import HeadLoss, MTPLoss, lm_loss, scale_grads


def reference_run(cfg, steps: int, lr: float, aux: float, mtp_weight: float | None = None) -> dict:
    """Per step: the mean loss over every (dp rank, micro-batch) chunk and the gradients, averaged the same
    way the mesh averages them (each chunk's loss backward, gradients / (dp x num_microbatches)). With MTP modules
    the loss backward is MTPLoss's (weight ``mtp_weight``, default the plan's runtime.mtp_loss_weight) on
    sequences of D more tokens; "losses" holds the next-token loss, "mtp_losses" the modules' mean."""
    spec, p, tr = cfg.model, cfg.parallel, cfg.training
    model = StageModel(spec, 0, spec.num_layers, {"aux_loss_coeff": aux})
    init_stage(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    extra = spec.mtp_layers
    data = make_source(None, spec.vocab_size, tr.seq_len, 0, extra)
    loss_fn = lm_loss
    if extra:
        loss_fn = MTPLoss(model, HeadLoss(model), cfg.runtime.mtp_loss_weight if mtp_weight is None else mtp_weight)
    out = {"losses": [], "mtp_losses": [], "grads": [],
           "init": {n: q.detach().clone() for n, q in model.named_parameters()}}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        batch, losses = data.batch(step, tr.global_batch), []
        if extra:
            loss_fn.parts.clear()
        for d in range(p.dp):
            x, y = dp_slice(batch, d, p.dp, extra)
            for xm, ym in zip(x.chunk(p.num_microbatches), y.chunk(p.num_microbatches)):
                loss = loss_fn(model(xm), ym)
                loss.backward()
                losses.append(float(loss.detach()))
        scale_grads(model, p.dp * p.num_microbatches)
        if extra:
            losses = [float(main) for main, _ in loss_fn.parts]
            out["mtp_losses"].append(sum(float(m) for _, m in loss_fn.parts) / len(loss_fn.parts))
        out["losses"].append(sum(losses) / len(losses))
        out["grads"].append({n: q.grad.clone() for n, q in model.named_parameters()})
        opt.step()
    return out


def whole_model_name(name: str) -> str:
    """An interleaved rank's ``chunks.<v>.layers.<i>...`` -> the whole model's ``layers.<i>...``."""
    return name.split(".", 2)[2] if name.startswith("chunks.") else name


def assert_initial_weights_equal(ref: dict, result: dict) -> None:
    """A rank's weights before its first step (meta-device build, tp split, FSDP2 shards, then the seeded init
    of its own part: model.materialize) equal the whole model's ``init_stage`` bit for bit; local experts their
    slice of the stacked experts."""
    assert result["init"], "the rank recorded no weights"
    for name, value in result["init"].items():
        whole = whole_model_name(name)
        want = ref["init"][whole]
        if ".experts." in whole:
            first = result["first_expert"][int(whole.split(".")[1])]
            want = want[first: first + value.shape[0]]
        assert torch.equal(value, want), f"{name}: initial weights differ from the whole model's"
