"""Checkpoints with torch.distributed.checkpoint (DCP), in layout-free keys: save under one layout (pp, dp, ep,
virtual stages, ZeRO), resume under another of the same model.

On disk (RUN_DIR/checkpoints/)::

    step_<N>/            one complete checkpoint (N = completed optimizer steps)
      .metadata          DCP's index: every key, its shape and the shard file / offset holding it
      __<r>_0.distcp     what rank r wrote (DCP writes each replicated key once, on one rank)
      piper.json         step, world, the saving layout (plan ``parallel``), the model spec, every MoE layer's slot map,
                         the training block and the learning-rate schedule's total steps
    latest               "N\\n": the newest complete checkpoint

Keys (one flat DCP state dict):

- ``model.<name>``: a dense parameter or buffer. ``<name>`` is its FQN with the interleaved schedule's
  ``chunks.<v>.`` prefix dropped (StageModel names layers by global index: ``layers.<i>...``), so it does not
  depend on pp or virtual stages.
- ``model.layers.<i>.mlp.experts.<e>.<w>``: routed expert **logical** id ``e``'s row of the stacked ``[El, ...]``
  weight ``w`` (w_in, w_gate, w_out, b_*), written by whichever rank holds ``e`` in its slots (MoE.slot_of_expert;
  replicas over edp hold the same values, DCP keeps one); so the key depends on neither ep nor migration.
- ``optim.<name>.<state>``: the optimizer state of that parameter (AdamW exp_avg, exp_avg_sq, step), per logical
  expert for experts. Under ZeRO-1 only the rank owning a parameter's shard has (and writes) its state.
- ``rng.rank<r>``: rank r's RNG states (torch, python, numpy, cuda).

A save writes into ``step_<N>.tmp/``; after a barrier rank 0 renames it to ``step_<N>/``, then points ``latest``
at it, then deletes all but the ``runtime.keep_checkpoints`` newest; a crash at any point leaves ``latest``
naming a complete checkpoint. A resume reads ``latest``; every rank checks, before any collective, that the
checkpoint is of the plan's model and holds every key (and shard file) that rank needs; one all_gather_object
brings every rank's first problem and its model keys (so that a saved key no rank places is found too), and all
ranks raise the same PiperError (train.run: one line, exit 2). What fails inside dcp.load on one rank reaches
every rank (DCP gathers exceptions in its planning and read steps) and becomes the same PiperError.

After a resume the slot map is the saved one when ep is unchanged (it names the same EP group-ranks and local
indices), else the identity of the new layout. RNG: under the saving layout (same ``parallel`` block and world)
every rank restores its own RNG states; under another one a rank's saved states have no meaning for its new role,
so every rank reseeds from (seed, step, rank) (reproducible; the data position is a function of the step).

DTensor parameters (TP, FSDP2): dense ones need nothing here: get_model_state_dict / get_optimizer_state_dict
return them as DTensors under the same FQNs and DCP saves and reshards them itself. Expert tensors go through
:func:`expert_rows` alone: for a stacked DTensor it must return, per logical expert held here, a DTensor of that
expert's row built from this rank's local rows (``DTensor.from_local(t.to_local()[j], mesh, placements)`` with the
placements shifted past the expert dimension), so that DCP still writes and loads in place. That needs the expert
dimension itself unsharded on a rank (FSDP2 ``shard_placement_fn`` on dim 1, not dim 0); where dim 0 is sharded,
``held_experts`` must also take the rank's row range. ``t.full_tensor()`` rows would work for saving but not for
loading in place (a copy back would be needed).
"""

from __future__ import annotations

import hashlib
import io
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from piper_plan.errors import PiperError
from piper_plan.fileio import atomic_write_json, atomic_write_text, read_document
from piper_plan.rundir import first_difference, latest_step, run_identity, short_repr

META = "piper.json"
MODEL, OPTIM, RNG = "model.", "optim.", "rng.rank"
_CHUNK_PREFIX = re.compile(r"^chunks\.\d+\.")
_STEP_DIR = re.compile(r"^step_(\d+)$")
_EXPERTS = ".experts."


# ---- paths, latest, rotation ---------------------------------------------------------------------
def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step}"


def mark_latest(run_dir: Path, step: int) -> None:
    """Rank 0, after ``step_<step>/`` is complete: point ``latest`` at it (atomic)."""
    atomic_write_text(checkpoints_dir(run_dir) / "latest", f"{step}\n")


def doomed(names: list[str], latest: int, keep: int) -> list[str]:
    """Entries of checkpoints/ to delete once ``latest`` moved: every ``step_<N>`` but the ``keep`` newest up to
    ``latest``, and leftovers of interrupted saves (``.tmp``, ``.old``)."""
    steps = sorted((int(m.group(1)) for m in map(_STEP_DIR.match, names) if m), reverse=True)
    kept = [s for s in steps if s <= latest][:keep]
    complete = [f"step_{s}" for s in steps if s not in kept]
    return complete + [n for n in names if n.startswith("step_") and n.endswith((".tmp", ".old"))]


def rotate(run_dir: Path, latest: int, keep: int) -> None:
    root = checkpoints_dir(run_dir)
    for name in doomed(sorted(p.name for p in root.iterdir()), latest, keep):
        shutil.rmtree(root / name, ignore_errors=True)


# ---- layout-free keys (pure) -----------------------------------------------------------------------
def layout_free_name(fqn: str) -> str:
    """A module FQN without the interleaved schedule's ``chunks.<v>.`` prefix."""
    return _CHUNK_PREFIX.sub("", fqn)


def expert_key(name: str, expert: int) -> str:
    """``layers.3.mlp.experts.w_in`` + logical expert 5 -> ``layers.3.mlp.experts.5.w_in``."""
    head, leaf = name.rsplit(".", 1)
    return f"{head}.{expert}.{leaf}"


def layer_of(name: str) -> int:
    return int(name.split(".")[1])


def held_experts(slot_of_expert: list[int], first_slot: int, num_local: int) -> list[tuple[int, int]]:
    """(logical expert, local index) of every expert in this rank's slots [first_slot, first_slot + El)."""
    return sorted((e, s - first_slot) for e, s in enumerate(slot_of_expert) if first_slot <= s < first_slot + num_local)


# ---- the flat state dict -------------------------------------------------------------------------------
def torch_optimizers(optimizers) -> list:
    """The torch optimizers of runtime/optim.Optimizers (ZeroRedundancyOptimizer keeps its shard's in ``.optim``)."""
    return [getattr(o, "optim", o) for o in optimizers.optims]


def expert_rows(name: str, tensor: torch.Tensor, held: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """{layout-free key: tensor} of one stacked expert tensor ``[El, ...]`` (a parameter or an optimizer state
    shaped like it: row j is local expert j), or of a per-tensor scalar (Adam's ``step``: every logical expert
    of the tensor gets the same one). Views, so that dcp.load writes into the tensor itself. The one place that
    knows how expert tensors are laid out on a rank (plain tensors; DTensors: the module notes)."""
    if tensor.dim() == 0:
        return {expert_key(name, e): tensor for e, _ in held}
    return {expert_key(name, e): tensor[j] for e, j in held}


def flat_state(model_sd: dict, optim_sds: list[dict], held: dict[int, list[tuple[int, int]]], rank: int) -> dict:
    """This rank's model and optimizer state dicts (RankState.torch_state) -> the layout-free DCP state dict.
    ``held``: per MoE layer, this rank's (logical expert, local index). Slot maps are not in it (piper.json)."""
    flat: dict = {}
    for fqn, t in model_sd.items():
        name = layout_free_name(fqn)
        if name.endswith(".slot_of_expert"):
            continue
        if _EXPERTS in name:
            flat.update({MODEL + k: v for k, v in expert_rows(name, t, held[layer_of(name)]).items()})
        else:
            flat[MODEL + name] = t
    for fqn, state in ((f, st) for sd in optim_sds for f, st in sd["state"].items()):
        name = layout_free_name(fqn)
        for key, t in state.items():
            if _EXPERTS in name:
                flat.update({f"{OPTIM}{k}.{key}": v for k, v in expert_rows(name, t, held[layer_of(name)]).items()})
            else:
                flat[f"{OPTIM}{name}.{key}"] = t
    flat[f"{RNG}{rank}"] = _rng_bytes()
    return flat


def _rng_bytes() -> bytes:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _set_rng(data: bytes) -> None:
    state = torch.load(io.BytesIO(data), weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def reseed(seed: int, step: int, rank: int) -> None:
    """Every RNG from (seed, step, rank): a resume under another layout."""
    value = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:4], "little")
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


def leaf_optimizer_state(module, optim, dtensor_of: dict) -> dict:
    """get_optimizer_state_dict's ``{"state": {FQN: {key: value}}}`` for an optimizer that steps local-shard leaves
    of DTensor parameters (runtime/optim.py: ZeRO-1 with tp; ``dtensor_of``: leaf -> parameter): the parameter's
    FQN, and each state tensor shaped like a leaf as a DTensor with its parameter's mesh and placements over the
    same storage, so that DCP saves and reshards it as a tp run's AdamW state, and dcp.load writes into it. A fresh
    optimizer first gets its state from torch's own zero-learning-rate step (as get_optimizer_state_dict does)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.tensor import DTensor

    def as_param(value, leaf, param):
        if param is leaf or not torch.is_tensor(value) or value.shape != leaf.shape:
            return value
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)

    _init_optim_state(optim)
    fqn = {q: name for name, q in module.named_parameters()}
    state = {}
    for leaf in (q for g in optim.param_groups for q in g["params"]):
        param = dtensor_of.get(leaf, leaf)
        if leaf in optim.state:
            state[fqn[param]] = {k: as_param(v, leaf, param) for k, v in optim.state[leaf].items()}
    return {"state": state}


class RankState:
    """This rank's part of a checkpoint: its module, optimizers and plan; the flat state dict in both directions."""

    def __init__(self, module, optimizers, cfg, rank: int, world: int) -> None:
        self.module, self.optims, self.cfg, self.rank, self.world = module, torch_optimizers(optimizers), cfg, rank, world
        self.dtensor_of = optimizers.dtensor_of

    def torch_state(self) -> tuple[dict, list[dict]]:
        """The module's state dict and each optimizer's (torch.distributed.checkpoint.state_dict: FQN-keyed,
        references to the live tensors for plain modules; a fresh optimizer gets its state created by a
        zero-learning-rate step first; one over local-shard leaves: leaf_optimizer_state). One optimizer at a
        time: a ZeRO-1 shard may hold an empty parameter group, which get_state_dict / set_state_dict refuse for
        several optimizers at once."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        optim_sds = [leaf_optimizer_state(self.module, o, leaves) if leaves
                     else get_optimizer_state_dict(self.module, o) for o, leaves in zip(self.optims, self.dtensor_of)]
        return get_model_state_dict(self.module), optim_sds

    def held(self) -> dict[int, list[tuple[int, int]]]:
        return {i: held_experts(m.slot_of_expert.tolist(), m.first_expert, m.num_local)
                for i, m in self.module.moe_layers().items()}

    def slot_maps(self) -> dict[str, list[int]]:
        return {str(i): m.slot_of_expert.tolist() for i, m in self.module.moe_layers().items()}

    def meta(self, step: int, slot_maps: dict) -> dict:
        return {"step": step, "world": self.world, "parallel": self.cfg.parallel.model_dump(mode="json"),
                "model": self.cfg.model.model_dump(mode="json"), "slot_of_expert": slot_maps,
                "training": self.cfg.training.model_dump(mode="json"), "steps": self.cfg.runtime.steps}


# ---- save --------------------------------------------------------------------------------------------
def save(run_dir: Path, step: int, state: RankState, keep: int) -> Path:
    """Collective (every rank): write ``step_<step>`` atomically, move ``latest``, rotate (module notes)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    maps: list = [None] * state.world
    dist.all_gather_object(maps, state.slot_maps())  # every stage's layers, for piper.json
    problem = None
    if state.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)      # a save interrupted before
            tmp.mkdir(parents=True)
            atomic_write_json(tmp / META, state.meta(step, {k: v for m in maps for k, v in m.items()}))
        except (OSError, PiperError) as exc:
            problem = _write_problem(exc)
    _agree(problem, state.world, step, tmp)          # also the barrier before the other ranks write into tmp
    model_sd, optim_sds = state.torch_state()
    try:
        dcp.save(flat_state(model_sd, optim_sds, state.held(), state.rank), checkpoint_id=str(tmp))
    except CheckpointException as exc:                # DCP gathers every rank's failure: the same on each
        rank, (error, _) = min(exc.failures.items())
        raise PiperError(_cannot_write(step, f"rank {rank}: {_write_problem(error)}"), path=str(tmp)) from None
    dist.barrier()
    if state.rank == 0:
        try:
            _install(tmp, final)
            mark_latest(run_dir, step)
            rotate(run_dir, step, keep)
        except (OSError, PiperError) as exc:
            problem = _write_problem(exc)
    _agree(problem, state.world, step, final)        # and the barrier after which ``latest`` names it
    return final


def _write_problem(exc: BaseException) -> str:
    """One line for a checkpoint write that failed (a full disk, a permission, an entry in the way)."""
    if isinstance(exc, PiperError):
        return exc.message
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    line = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {line[0] if line else ''}"


def _agree(problem: str | None, world: int, step: int, path: Path) -> None:
    """Collective: one PiperError on every rank where any rank has a ``problem`` writing the checkpoint."""
    import torch.distributed as dist

    problems: list = [None] * world
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise PiperError(_cannot_write(step, first), path=str(path))


def _cannot_write(step: int, problem: str) -> str:
    return (f"cannot write the checkpoint of step {step}: {problem}; free the space or the entry in the way, then "
            "--resume continues from the last checkpoint")


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished ``.tmp`` into place; an existing ``step_<N>`` (of an earlier run in this directory)
    is moved aside first and deleted by the rotation."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)


# ---- load ---------------------------------------------------------------------------------------------
def load(run_dir: Path, state: RankState) -> tuple[int, int | None]:
    """Collective: restore the ``latest`` checkpoint into this rank's module / optimizers / RNG under the current
    layout; return the step to continue from (0 without a checkpoint) and the total steps the saving run scheduled
    its learning rate over (None where piper.json does not say: written before it was kept). Both come from the one
    piper.json every rank read, its problems agreed on. Bad checkpoints: PiperError on every rank."""
    import torch.distributed as dist

    step = _agreed_latest_step(run_dir, state.world)
    if step is None:
        return 0, None
    path = step_dir(run_dir, step)
    meta, problem = _read_meta(path, state)
    flat = None
    if problem is None:
        same_ep = meta["parallel"]["ep"] == state.cfg.parallel.ep
        problem = _install_slot_maps(state, meta["slot_of_expert"] if same_ep else None)
    if problem is None:
        model_sd, optim_sds = state.torch_state()
        flat = flat_state(model_sd, optim_sds, state.held(), state.rank)
        same_layout = meta["parallel"] == state.cfg.parallel.model_dump(mode="json") and meta["world"] == state.world
        if not same_layout:
            del flat[f"{RNG}{state.rank}"]
        problem = _missing(path, flat)
    mine = sorted(k for k in flat or () if k.startswith(MODEL))
    gathered: list = [None] * state.world
    dist.all_gather_object(gathered, (problem, mine))  # the one collective before DCP: every rank reaches it
    first = next((p for p, _ in gathered if p), None) or _unplaced(path, {k for _, keys in gathered for k in keys})
    if first:
        raise PiperError(first, path=str(path))
    _dcp_load(flat, path)
    gathered = [None] * state.world
    dist.all_gather_object(gathered, _damaged_value(flat))     # every rank refuses, or none does
    first = next((p for p in gathered if p), None)
    if first:
        raise PiperError(f"{first}; piper saves finite weights and optimizer state only (a run whose loss went nan "
                         "stops before its checkpoint), so the files are damaged: point checkpoints/latest at an "
                         "earlier step_<N>, or start over with --force", path=str(path))
    _restore(state, model_sd, optim_sds, flat, step, same_layout)
    saved = meta.get("steps")
    return step, saved if type(saved) is int and saved >= 1 else None


def _damaged_value(flat: dict) -> str | None:
    """The first loaded value no run of piper saves: a non-finite weight or optimizer state, or a negative second
    moment (AdamW's exp_avg_sq is a mean of squares); None if every value of this rank could have been saved."""
    for key, value in flat.items():
        if not torch.is_tensor(value) or not value.is_floating_point():
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        if not bool(torch.isfinite(local).all()):
            return f"{key!r} holds a non-finite value (nan or inf)"
        if key.endswith(".exp_avg_sq") and bool((local < 0).any()):
            return f"{key!r} holds a negative second moment"
    return None


def _agreed_latest_step(run_dir: Path, world: int) -> int | None:
    """Collective: the step ``checkpoints/latest`` names, the same on every rank, or one PiperError on every rank
    (a damaged file, or a run directory not every node sees: before, the ranks that saw no checkpoint went on to
    the next collective while the others loaded, and the job hung)."""
    import torch.distributed as dist

    try:
        step, problem = latest_step(run_dir), None
    except PiperError as exc:
        step, problem = None, str(exc)
    seen: list = [None] * world
    dist.all_gather_object(seen, (problem, step))
    first = next((p for p, _ in seen if p), None)
    if first:
        raise PiperError(first)
    other = next((r for r, (_, s) in enumerate(seen) if s != seen[0][1]), None)
    if other is not None:
        shown = [("none" if s is None else f"step {s}") for _, s in (seen[0], seen[other])]
        raise PiperError(f"names {shown[0]} on rank 0 but {shown[1]} on rank {other}; allowed: one run directory "
                         "every rank sees (a folder shared by all nodes)", path=str(run_dir / "checkpoints" / "latest"))
    return step


def _read_meta(path: Path, state: RankState) -> tuple[dict | None, str | None]:
    """piper.json of a checkpoint and the first reason it cannot be resumed by this plan (None: it can)."""
    if not (path / META).is_file() or not (path / ".metadata").is_file():
        return None, f"not a complete checkpoint (no {META} or .metadata)"
    try:
        meta = read_document(path / META)
    except PiperError as exc:
        return None, str(exc)
    for key, kind in _META_FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            what = "no" if key not in meta else f"a {type(meta[key]).__name__} as its"
            return None, (f"{META} has {what} {key!r}; allowed: the {META} piper writes with every checkpoint "
                          f"({', '.join(_META_FIELDS)}); this checkpoint is damaged or not piper's")
    if not isinstance(meta["parallel"].get("ep"), int):
        return None, f"{META} has no 'parallel.ep'; allowed: the {META} piper writes; this checkpoint is damaged"
    diff = first_difference(meta.get("model"), state.cfg.model.model_dump(mode="json"))
    if diff:
        return meta, f"the checkpoint is of another model: model.{diff}"
    if isinstance(meta.get("training"), dict):      # kept since 2026-12-05: earlier checkpoints do not say
        diff = first_difference(run_identity("training", meta["training"]),
                                run_identity("training", state.cfg.training.model_dump(mode="json")))
        if diff:
            return meta, f"the checkpoint is of another training: training.{diff}"
    return meta, None


_META_FIELDS = {"model": dict, "parallel": dict, "world": int, "step": int, "slot_of_expert": dict}
"""What load needs of piper.json, and its type (``training`` and ``steps``, kept since 2026-12-05, are read where
present)."""


def _install_slot_maps(state: RankState, saved: dict | None) -> str | None:
    """The saved slot maps (same ep) or the identity (another ep); the first problem of a damaged saved map
    (nothing installed then), else None."""
    rows = {}
    for i, m in state.module.moe_layers().items():
        row = saved.get(str(i)) if saved is not None else list(range(m.spec.num_experts))
        whole = isinstance(row, list) and all(type(x) is int for x in row)    # not bool, str or float
        if not whole or sorted(row) != list(range(m.spec.num_experts)):
            return (f"{META}: slot_of_expert.{i}: {short_repr(row)}; allowed: a permutation of the layer's "
                    f"{m.spec.num_experts} experts, as piper writes it; this checkpoint is damaged")
        rows[i] = row
    for i, m in state.module.moe_layers().items():
        m.slot_of_expert.copy_(torch.as_tensor(rows[i], dtype=torch.int64))
    return None


def _missing(path: Path, flat: dict) -> str | None:
    """The first key of ``flat`` the checkpoint lacks, holds with another shape, or whose shard file is missing."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = _dcp_metadata(path)
    except PiperError as exc:
        return exc.message
    for key, value in flat.items():
        saved = md.state_dict_metadata.get(key)
        if saved is None:
            return f"the checkpoint has no {key!r} (saved under a model or optimizer without it)"
        if torch.is_tensor(value) and isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != tuple(value.shape):
            return f"{key!r} has shape {list(saved.size)} in the checkpoint, {list(value.shape)} in this plan"
    files = {info.relative_path for index, info in md.storage_data.items() if index.fqn in flat}
    for name in sorted(files):
        if not (path / name).is_file():
            return f"shard file {name} is missing"
    return None


def _dcp_metadata(path: Path):
    """DCP's .metadata of a checkpoint; unreadable (damaged, truncated) is one PiperError."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # an unpickling error of any kind: the file is not DCP's
        raise PiperError(f".metadata cannot be read ({type(exc).__name__}); allowed: the .metadata "
                         "torch.distributed.checkpoint writes; this checkpoint is damaged", path=str(path)) from None


def _unplaced(path: Path, placed: set[str]) -> str | None:
    """A saved model key that no rank of this layout loads (the same answer on every rank): e.g. the separate LM
    head a tie_embeddings model has under pp > 1, resumed at pp = 1, where the head is the embedding."""
    saved = {k for k in _dcp_metadata(path).state_dict_metadata if k.startswith(MODEL)}
    extra = sorted(saved - placed)
    if extra:
        return f"the checkpoint holds {extra[0]!r}, which no rank of this layout has a place for"
    return None


def _dcp_load(flat: dict, path: Path) -> None:
    """dcp.load in place; a failure on any rank reaches every rank (DCP gathers exceptions in its planning and
    read steps) and becomes the same one-line PiperError everywhere."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(flat, checkpoint_id=str(path))
    except CheckpointException as exc:
        rank, (error, _) = min(exc.failures.items())
        line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise PiperError(f"cannot load the checkpoint (rank {rank}: {type(error).__name__}: {line})",
                         path=str(path)) from None


def _restore(state: RankState, model_sd: dict, optim_sds: list[dict], flat: dict, step: int,
             same_layout: bool) -> None:
    """The loaded values (already in the live tensors: dcp.load wrote into views) through set_*_state_dict; RNG."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(state.module, model_sd)
    for optim, sd, leaves in zip(state.optims, optim_sds, state.dtensor_of):
        if not leaves:  # over local-shard leaves the state is the live one (leaf_optimizer_state): loaded in place
            set_optimizer_state_dict(state.module, optim, sd)
    if same_layout:
        _set_rng(flat[f"{RNG}{state.rank}"])
    else:
        reseed(state.cfg.runtime.seed, step, state.rank)
