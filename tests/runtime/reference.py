"""The single-process reference: the whole model on one rank, the same global batch and micro-batch chunks."""

from __future__ import annotations

import torch

from piper_plan.runtime.data import dp_slice, make_source
from piper_plan.runtime.model import StageModel, init_stage
from piper_plan.runtime.pipeline import lm_loss, scale_grads


def reference_run(cfg, steps: int, lr: float, aux: float) -> dict:
    """Per step: the mean loss over every (dp rank, micro-batch) chunk and the gradients, averaged the same
    way the mesh averages them (each chunk's loss backward, gradients / (dp x num_microbatches))."""
    spec, p, tr = cfg.model, cfg.parallel, cfg.training
    model = StageModel(spec, 0, spec.num_layers, {"aux_loss_coeff": aux})
    init_stage(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    data = make_source(None, spec.vocab_size, tr.seq_len, 0)
    out = {"losses": [], "grads": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        batch, losses = data.batch(step, tr.global_batch), []
        for d in range(p.dp):
            x, y = dp_slice(batch, d, p.dp)
            for xm, ym in zip(x.chunk(p.num_microbatches), y.chunk(p.num_microbatches)):
                loss = lm_loss(model(xm), ym)
                loss.backward()
                losses.append(float(loss.detach()))
        scale_grads(model, p.dp * p.num_microbatches)
        out["losses"].append(sum(losses) / len(losses))
        out["grads"].append({n: q.grad.clone() for n, q in model.named_parameters()})
        opt.step()
    return out
