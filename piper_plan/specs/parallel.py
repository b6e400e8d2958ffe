"""ParallelPlan: how one training run is split over ranks (vocabulary in DESIGN.md)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, model_validator

from piper_plan.specs.base import NotBool, Spec
from piper_plan.specs.training import MAX_COUNT
from piper_plan.specs.vocab import A2A, LayerSplit, Recompute, Schedule

MAX_RANKS = 2**20
"""The most ranks a plan may have (about 14x Frontier's 75,264 GCDs), and so the most any degree, micro-batch size
(mbs) or layer count in it may be; the sequences of a step (dp x mbs x num_microbatches) are at most the global
batch's MAX_COUNT: every product the planner forms stays inside its 64-bit integers."""
Degree = Annotated[int, Field(ge=1, le=MAX_RANKS)]
"""A degree, a micro-batch size or a layer count of a plan."""
MAX_BALANCED_LAYERS = 1024
"""Models of more layers (none published has more than a few hundred) get the even split only: the exact
FLOP-balanced partition (cost/pipeline.py) costs pp x L^2 (10,000 layers: minutes per plan)."""


class ParallelPlan(Spec):
    """Degrees and schedule. world = pp x dp x cp x tp; experts regroup a stage's dp x cp x tp ranks as
    ep x etp x edp (Megatron-Core); rank order tp, cp, dp, pp, fastest first (docs/design-notes.md)."""

    dp: Degree = 1
    """Data-parallel degree of the dense weights (their gradients are reduced over dp x cp)."""
    cp: Degree = 1
    """Context-parallel degree: each sequence split over cp ranks in 2 cp chunks, rank i holding chunks i and
    2 cp - 1 - i (the load-balanced causal split of Megatron-Core / Transformer Engine), K and V passed around a
    ring (docs/design-notes.md, "context parallelism")."""
    tp: Degree = 1
    """Tensor-parallel degree (inside a node)."""
    pp: Degree = 1
    """Pipeline stages."""
    ep: Degree = 1
    """Expert-parallel degree: ranks that split one MoE layer's experts."""
    etp: Degree = 1
    """Tensor-parallel degree inside an expert."""
    mbs: Degree = 1
    """Micro-batch size, sequences."""
    num_microbatches: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    """Micro-batches per step per pipeline = global_batch / (dp x mbs)."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """Pipeline schedule."""
    virtual_stages: Degree = 1
    """Model chunks per rank for the interleaved schedule (1 otherwise)."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism (Korthikanti et al. 2022): with tp > 1 the activations outside the tp
    region (norms, dropout, residual stream) are split over tp too; False = tensor parallelism only. The one
    place this setting lives: the cost model reads it from the plan."""
    zero: Annotated[Literal[0, 1, 2, 3], NotBool] = 0
    """ZeRO stage, over dp (dense weights) and edp (experts): 1 shards master weights and optimizer state
    (a sharded optimizer); 2 and 3 are FSDP2 (parameters, gradients and optimizer state sharded at rest;
    2 keeps the gathered parameters from forward to backward, 3 re-gathers them). What each holds and sends
    per step: docs/design-notes.md, "zero 0-3"."""
    dp_replicate: Degree = 1
    """HSDP (zero 2 / 3 only): the stage's dp x cp ranks form ``dp_replicate`` replicas of an FSDP2 shard group of
    dp x cp / dp_replicate consecutive ranks; dense weights, gradients and optimizer state are sharded inside a
    shard group, and gradients all-reduced across the replicas. 1 = sharded over all dp x cp. Experts shard over
    edp as ever. Not searched: `piper estimate --dp-replicate` (docs/design-notes.md, "zero 0-3")."""
    a2a: A2A = A2A.FLAT
    """Expert all-to-all algorithm."""
    layers_split: LayerSplit = LayerSplit.AUTO
    """How layers are split over stages: even, FLOP-balanced, auto (what ``piper plan`` does: the one that fits,
    then the faster) or explicit (``layers_per_stage``). Saved plans carry the resolved explicit list."""
    layers_per_stage: list[Degree] | None = None
    """Layers of each pipeline stage (given: the split is explicit)."""
    virtual_stage_layers: list[NonNegativeInt] | None = None
    """Interleaved only: decoder layers of each of the pp x virtual_stages model chunks, in Megatron-Core's
    virtual-stage order (chunk ``k`` runs on rank ``k % pp`` as its virtual stage ``k // pp``; the decoder counts
    of a ``pipeline_model_parallel_layout``; such a layout string is read as its decoder counts,
    ``layout_decoder_counts``). None: ``interleaved_chunk_split``'s rule."""

    @model_validator(mode="before")
    @classmethod
    def _explicit_split(cls, data):
        """A layers_per_stage list makes the split explicit; an explicit split needs the list."""
        if isinstance(data, dict) and data.get("layers_per_stage") is not None \
                and data.get("layers_split", LayerSplit.AUTO) == LayerSplit.AUTO:
            data = {**data, "layers_split": LayerSplit.EXPLICIT}
        return data

    @model_validator(mode="before")
    @classmethod
    def _layout_string(cls, data):
        """A Megatron-Core layout string for virtual_stage_layers stands for its decoder counts."""
        if isinstance(data, dict) and isinstance(data.get("virtual_stage_layers"), str):
            data = {**data, "virtual_stage_layers": layout_decoder_counts(data["virtual_stage_layers"])}
        return data

    @model_validator(mode="after")
    def _products_in_range(self) -> "ParallelPlan":
        if self.world > MAX_RANKS:
            raise ValueError(f"world = pp x dp x cp x tp = {self.world:,} ranks; a plan has at most {MAX_RANKS:,}")
        if self.dp * self.mbs * self.num_microbatches > MAX_COUNT:
            raise ValueError(f"dp x mbs x num_microbatches = {self.dp * self.mbs * self.num_microbatches:,} sequences "
                             f"a step; at most {MAX_COUNT:,} (the largest global batch)")
        return self

    @model_validator(mode="after")
    def _split_has_list(self) -> "ParallelPlan":
        if (self.layers_split == LayerSplit.EXPLICIT) != (self.layers_per_stage is not None):
            raise ValueError(f"layers_split={self.layers_split.value} and layers_per_stage={self.layers_per_stage}: "
                             "an explicit split is given by its layers_per_stage list, and only then")
        return self

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (expert gradients are reduced over them)."""
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per stage: the explicit list, else the even split (cost/pipeline.py resolves the others);
        interleaved with uneven chunks: each rank's total over its chunks."""
        if self.layers_per_stage is not None:
            return list(self.layers_per_stage)
        chunks = self.chunk_layers(num_layers)
        if chunks is not None and len(set(chunks)) > 1:
            return rank_layers(chunks, self.pp)
        return even_split(num_layers, self.pp)

    def chunk_layers(self, num_layers: int) -> list[int] | None:
        """Interleaved: layers of each model chunk in virtual-stage order (the explicit list, else the rule);
        None for other schedules, or where the rule has no split."""
        if self.schedule != Schedule.INTERLEAVED:
            return None
        return model_chunks(num_layers, self.pp, self.virtual_stages, self.virtual_stage_layers)

    def degrees(self) -> dict[str, int]:
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp,
                "edp": self.edp}

    def settings_text(self) -> str:
        """One line of every degree and setting, as the estimate header and exported scripts show them: cp always,
        the interleaved schedule with its chunks per rank, HSDP's replicas and tensor parallelism without sequence
        parallelism where set."""
        degrees = " ".join(f"{k}={v}" for k, v in self.degrees().items())
        schedule = self.schedule.value + (f" v={self.virtual_stages}" if self.schedule == Schedule.INTERLEAVED else "")
        zero = f"zero={self.zero}" + (f" dp_replicate={self.dp_replicate}" if self.dp_replicate > 1 else "")
        degrees += " sequence_parallel=off" if self.tp > 1 and not self.sequence_parallel else ""
        return (f"{degrees} mbs={self.mbs} microbatches={self.num_microbatches} {schedule} "
                f"recompute={self.recompute.value} {zero} a2a={self.a2a.value}")


def even_split(num_layers: int, pp: int) -> list[int]:
    """Split ``num_layers`` over ``pp`` stages as evenly as possible; extra layers go to the later stages
    (stage 0 holds the embedding and the most micro-batches in flight under 1F1B)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i >= pp - extra else 0) for i in range(pp)]


def interleaved_chunk_split(num_layers: int, pp: int, virtual_stages: int) -> list[int] | None:
    """Layers of each of the pp x v model chunks (virtual-stage order) as Megatron-Core splits them without an
    explicit layout, or None where it cannot.

    Megatron-Core (NVIDIA/Megatron-LM commit 00caa53, megatron/core/transformer/transformer_block.py
    ``get_num_layers_to_build`` and transformer_layer.py ``get_transformer_layer_offset``) counts the embedding
    and / or the loss as one layer each when ``account_for_embedding_in_pipeline_split`` /
    ``account_for_loss_in_pipeline_split`` are set, needs that count divisible by pp and each rank's share by v,
    gives every chunk the same count, and builds one decoder layer fewer in the first chunk (virtual stage 0 of
    rank 0; embedding) and in the last (virtual stage v - 1 of rank pp - 1; loss). The rule here takes the first
    of: neither (num_layers divisible by pp x v: the even split), both (num_layers + 2 divisible: Megatron-Bridge's
    Qwen3 MoE recipes set both, src/megatron/bridge/recipes/qwen/qwen3_moe.py), the loss alone (num_layers + 1
    divisible: the last chunk also holds the LM head); piper keeps every chunk at >= 1 layer (Megatron allows an empty
    one). Other splits (``num_layers_in_first/last_pipeline_stage``,
    a ``pipeline_model_parallel_layout``) are stated as an explicit ``virtual_stage_layers`` list."""
    n = pp * virtual_stages
    for embedding, loss in ((0, 0), (1, 1), (0, 1)):
        if (num_layers + embedding + loss) % n == 0 and (num_layers + embedding + loss) // n > max(embedding, loss):
            chunks = [(num_layers + embedding + loss) // n] * n
            chunks[0] -= embedding
            chunks[-1] -= loss
            return chunks
    return None


def model_chunks(num_layers: int, pp: int, virtual_stages: int, explicit=None) -> list[int] | None:
    """Layers of each model chunk of an interleaved plan, in virtual-stage order: the ``explicit`` list
    (``virtual_stage_layers``) where given, else Megatron-Core's rule (``interleaved_chunk_split``; None where it has
    no split). The one place that choice is made, for a plan object, a batch row and the cost model alike."""
    if explicit is not None:
        return list(explicit)
    return interleaved_chunk_split(num_layers, pp, virtual_stages)


def rank_layers(chunks: list[int], pp: int) -> list[int]:
    """Each rank's layers over its model chunks (chunk k on rank k % pp)."""
    return [sum(chunks[r::pp]) for r in range(pp)]


_LAYOUT_REPEAT = (re.compile(r"\(([^()]*)\)\*([0-9]+)"), re.compile(r"([Etm|L])\*([0-9]+)"))
_LAYOUT_ORDER = re.compile(r"E?[t|]*m*\|*L?")
"""An expanded layout's order: E, the decoder layers and chunk ends, the MTP layers in one chunk, L."""
_LAYOUT_MAX_CHARS = 1_000_000
"""A layout expands to at most this many characters (100 per layer of the largest model a spec may hold)."""


def layout_decoder_counts(layout: str) -> list[int]:
    """Decoder layers per model chunk of a Megatron-Core ``pipeline_model_parallel_layout`` string, e.g.
    "Et|(tt|)*30mL" -> [1, 2 x 30, 0]. Grammar of megatron/core/transformer/pipeline_parallel_layer_layout.py
    (NVIDIA/Megatron-LM commit 00caa53, ``parse_str_to_list``): ``|`` ends a chunk, E embedding, t a decoder
    layer, m an MTP layer, L the loss, ``(...)*n`` and ``x*n`` repeat, commas are cosmetic. piper prices the MTP
    modules and the loss on the last rank wherever the layout puts them. Order (Megatron-Core's
    ``validate_layer_layout``): E at most once, first in the first chunk; L at most once, last in the last chunk;
    the MTP layers m together in one chunk after every t (e.g. "...tmL" or "...t|m|L")."""
    return [chunk.count("t") for chunk in expand_layout(layout).split("|")]


def layout_mtp_layers(layout: str) -> int:
    """MTP layers (m) a layout string places; Megatron-Core requires as many as the model trains."""
    return expand_layout(layout).count("m")


def check_layout_mtp(layout, mtp_layers: int, field: str = "parallel.virtual_stage_layers") -> None:
    """A layout string (``virtual_stage_layers`` as given) placing another number of MTP layers than the model
    trains is one error line (Megatron-Core's validate_layer_layout requires them equal)."""
    if not isinstance(layout, str):
        return
    placed = layout_mtp_layers(layout)
    if placed != mtp_layers:
        from piper_plan.errors import PiperError

        raise PiperError(f"layout {layout!r} places {placed} MTP layer(s) (m) and the model trains {mtp_layers}: "
                         "make them equal (m before L, or the trained MTP layers)", field=field)


def expand_layout(layout: str) -> str:
    """A layout string with its repeats expanded and checked (layout_decoder_counts' grammar and order)."""
    text = layout.replace(",", "").replace(" ", "")

    expanded = [len(text)]   # characters the repeats have made so far: bounded before each one is built

    def repeat(m: re.Match) -> str:
        digits = m.group(2).lstrip("0") or "0"     # a count of thousands of digits: int() refuses it
        count = int(digits) if len(digits) <= len(str(_LAYOUT_MAX_CHARS)) else _LAYOUT_MAX_CHARS + 1
        expanded[0] += len(m.group(1)) * count
        if expanded[0] > _LAYOUT_MAX_CHARS or count > _LAYOUT_MAX_CHARS:   # "()*10**20": "" * count overflows
            raise ValueError(f"layout {layout!r}: its repeats expand past {_LAYOUT_MAX_CHARS:,} characters")
        return m.group(1) * count
    for pattern in _LAYOUT_REPEAT:
        text = pattern.sub(repeat, text)
    bad = set(text) - set("Etm|L")
    if bad & set("()*"):
        raise ValueError(f"layout {layout!r}: a repeat piper cannot read; allowed (...)*n or x*n with a whole n >= 0, "
                         "parentheses not nested")
    if bad:
        raise ValueError(f"layout {layout!r}: unknown characters {sorted(bad)}; allowed E, t, m, L, |, (...)*n, x*n, "
                         "or a list of layer counts")
    misplaced = [rule for rule, wrong in (
        ("the embedding E at most once, first in the first chunk", text.count("E") > 1 or "E" in text[1:]),
        ("the loss L at most once, last in the last chunk", text.count("L") > 1 or "L" in text[:-1]),
        ("the MTP layers m together in one chunk after every t", not _LAYOUT_ORDER.fullmatch(text))) if wrong]
    if misplaced:
        raise ValueError(f"layout {layout!r}: misplaced layers; allowed: {misplaced[0]}")
    return text


def layout_string(chunks: list[int], mtp_layers: int = 0) -> str:
    """A Megatron-Core ``pipeline_model_parallel_layout`` of decoder counts per chunk (virtual-stage order): the
    embedding in the first chunk, the MTP modules and the loss in the last (where piper prices them);
    ``layout_decoder_counts`` reads it back."""
    body = ["t" * n if n < 3 else f"t*{n}" for n in chunks]
    body[0] = "E" + body[0]
    body[-1] += "m" * mtp_layers + "L"
    return "|".join(body)
