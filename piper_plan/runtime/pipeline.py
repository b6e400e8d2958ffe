"""Pipeline execution: torch.distributed.pipelining (GPipe / 1F1B / interleaved 1F1B, shapes inferred at the
first step) for pp > 1, a plain micro-batch loop for pp = 1. Both average the loss over micro-batches
(scale_grads). Interleaved: the rank's module is a model.VirtualStages; chunk v is pipeline stage
pp_index + v x pp of pp x virtual_stages (ScheduleInterleaved1F1B, Narayanan et al. 2021)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch. Vocabulary-sharded DTensor logits (tp > 1) need
    tensor_parallel.loss_context around the loss and its backward; the loss returned is a plain tensor."""
    from piper_plan.runtime.tensor_parallel import local_tensor

    return local_tensor(F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1)))


class ChunkedLoss:
    """The mean next-token cross entropy of one micro-batch from the last stage's final hidden states
    (``StageModel.return_hidden``), ``chunk_rows`` logit rows at a time: each chunk's LM head + cross entropy is
    checkpointed (torch.utils.checkpoint, non-reentrant), so forward keeps no logits and backward recomputes one
    chunk's at a time; no fp32 logits of the whole micro-batch exist. Under tp the logits stay
    vocabulary-parallel (``loss_parallel``, as lm_loss); an untied head gathers the sequence shards of each chunk
    (tensor_parallel.py), whose targets are then every tp rank's positions of that chunk, in gather order."""

    def __init__(self, stage, chunk_rows: int, seq_shards: int) -> None:
        """seq_shards: tp where the hidden states arrive sequence-sharded (an untied head under tp), else 1."""
        self.stage, self.chunk_rows, self.seq_shards = stage, chunk_rows, seq_shards

    def __call__(self, h_BsD: torch.Tensor, targets_BS: torch.Tensor, weight=None) -> torch.Tensor:
        """``weight``: the head weight the caller took for this micro-batch (StageModel.head_weight), else taken
        here, once for every chunk."""
        from torch.utils.checkpoint import checkpoint

        weight = self.stage.head_weight(h_BsD) if weight is None else weight
        B, s = h_BsD.shape[0], h_BsD.shape[1]                          # s: this rank's sequence positions
        step = max(1, self.chunk_rows // (B * self.seq_shards))
        y_BPs = targets_BS.reshape(B, self.seq_shards, s)
        total = 0.0
        for h_chunk, y_chunk in zip(h_BsD.split(step, dim=1), y_BPs.split(step, dim=2)):
            total = total + checkpoint(self._chunk_sum, h_chunk, y_chunk.reshape(B, -1), weight, use_reentrant=False)
        return total / targets_BS.numel()

    def _chunk_sum(self, h_BcD, y_Bc, weight):
        from piper_plan.runtime.tensor_parallel import local_tensor

        logits = self.stage.logits(h_BcD, weight)
        return local_tensor(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_Bc.reshape(-1), reduction="sum"))


class HeadLoss:
    """lm_loss of the LM head's logits of final hidden states (the whole micro-batch at once)."""

    def __init__(self, stage) -> None:
        self.stage = stage

    def __call__(self, h_BSD: torch.Tensor, targets_BS: torch.Tensor, weight=None) -> torch.Tensor:
        return lm_loss(self.stage.logits(h_BSD, weight), targets_BS)


class MTPLoss:
    """DeepSeek-V3's training objective (report sec. 2.2, eq. 21-25): the next-token loss plus ``weight`` times the
    mean over the D MTP modules of their cross entropies, module k (0-based) predicting the token k + 2 ahead.
    Runs the last stage's MTP modules (model.MTPModule) on its final hidden states ``h_BSD``; ``targets_BT``
    holds the S next tokens and D more (data.dp_slice with ``extra`` = D): module k embeds targets[:, k : S + k]
    (the tokens shifted by k + 1) with the shared embedding and is scored on targets[:, k + 1 : S + k + 1], both
    through ``head_loss`` (HeadLoss or ChunkedLoss: the shared LM head). ``parts`` keeps each micro-batch's
    (main loss, MTP mean) detached, for the report."""

    def __init__(self, stage, head_loss, weight: float) -> None:
        self.stage, self.head_loss, self.weight = stage, head_loss, weight
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, h_BSD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        modules = list(self.stage.mtp.values())
        S = targets_BT.shape[1] - len(modules)
        weight = self.stage.head_weight(h_BSD)              # one 16-bit head weight for all 1 + D losses
        main = self.head_loss(h_BSD, targets_BT[:, :S], weight)
        mtp = 0.0
        for k, module in enumerate(modules):
            h_BSD = module(h_BSD, self.stage.embed(targets_BT[:, k: S + k]))
            mtp = mtp + self.head_loss(h_BSD, targets_BT[:, k + 1: S + k + 1], weight)
        mtp = mtp / len(modules)
        self.parts.append((main.detach(), mtp.detach()))
        return main + self.weight * mtp


def loss_function(module, rows: int, chunk_rows: int | None, tp: int, mtp_weight: float = 0.0):
    """The LM loss of this rank's module (micro-batches of ``rows`` tokens): ChunkedLoss where a micro-batch has
    more rows than ``chunk_rows`` (its last stage then returns hidden states), else lm_loss on whole logits;
    MTPLoss around either where the last stage holds MTP modules (weight ``mtp_weight``)."""
    last = module.chunks[-1] if hasattr(module, "chunks") else module
    if not last.is_last:
        return lm_loss
    chunked = chunk_rows is not None and rows > chunk_rows
    if chunked:
        last.return_hidden = True
        head = ChunkedLoss(last, chunk_rows, tp if last.lm_head is not None else 1)
    else:
        head = HeadLoss(last) if len(last.mtp) else lm_loss
    return MTPLoss(last, head, mtp_weight) if len(last.mtp) else head


def build_schedule(module, pp_index: int, pp: int, pp_group, schedule: str, num_microbatches: int, device,
                   loss_fn=lm_loss):
    """A GPipe, 1F1B or interleaved 1F1B schedule over this rank's stage(s) (pp > 1)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    if schedule == "interleaved":
        chunks = list(module.chunks)
        n = pp * len(chunks)
        stages = [PipelineStage(c, pp_index + v * pp, n, device, group=pp_group) for v, c in enumerate(chunks)]
        return ScheduleInterleaved1F1B(stages, n_microbatches=num_microbatches, loss_fn=loss_fn)
    stage = PipelineStage(module, pp_index, pp, device, group=pp_group)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return cls(stage, n_microbatches=num_microbatches, loss_fn=loss_fn)


def run_pipeline(schedule, is_first: bool, is_last: bool, x, y) -> list[torch.Tensor]:
    """One step of the schedule; returns the last stage's per-micro-batch losses (empty elsewhere)."""
    losses: list[torch.Tensor] = []
    if is_first:
        schedule.step(x)
    elif is_last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return losses


def run_local(module, x, y, num_microbatches: int, loss_fn=lm_loss) -> list[torch.Tensor]:
    """pp = 1: forward/backward each micro-batch, then divide gradients by the micro-batch count (as the
    pipelining schedules' scale_grads do, so an in-stage balance loss is weighted the same way)."""
    losses = []
    for xm, ym in zip(x.chunk(num_microbatches), y.chunk(num_microbatches)):
        loss = loss_fn(module(xm), ym)
        loss.backward()
        losses.append(loss.detach())
    scale_grads(module, num_microbatches)
    return losses


def scale_grads(module, divisor: int) -> None:
    with torch.no_grad():
        for q in module.parameters():
            if q.grad is not None:
                q.grad /= divisor


class P2PTimer:
    """Seconds spent waiting on the schedule's point-to-point sends/receives (wraps pipelining's private
    ``_wait_batch_p2p`` helper once per process; 0 if a torch version lacks it)."""

    _instance: "P2PTimer | None" = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._install()
        return cls._instance

    def _install(self) -> None:
        from torch.distributed.pipelining import schedules

        self.seconds = 0.0
        self._orig = getattr(schedules, "_wait_batch_p2p", None)
        if self._orig is not None:
            schedules._wait_batch_p2p = self._timed

    def _timed(self, work):
        start = time.perf_counter()
        out = self._orig(work)
        self.seconds += time.perf_counter() - start
        return out
