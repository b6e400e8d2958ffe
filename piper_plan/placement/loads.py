"""Per-expert token loads for the migration planner: synthetic (Zipf, Dirichlet) or measured (a runtime
``metrics.jsonl``, DESIGN.md "Shared file formats": ``expert_tokens`` per MoE layer by logical expert id).

Shapes: loads are float ``[L, E]`` (``L`` MoE layers, ``E`` experts), tokens routed to each expert.
Generators are pure (numpy ``Generator`` in, array out); only :func:`read_metrics_loads` touches a file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from piper_plan.errors import PiperError
from piper_plan.metricsfile import json_lines

DEFAULT_TOKENS_PER_LAYER = 1 << 20
"""Routed token-slots per layer of synthetic loads (tokens x top_k); only the shares matter to the planner."""

SKEW_HELP = "zipf:S (S >= 0), dirichlet:A (A > 0), uniform, or a metrics.jsonl file"
DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
"""A plain ASCII decimal (S or A of --skew): no underscores, spaces, non-ASCII digits, hex, inf or nan."""


@dataclass(frozen=True)
class Skew:
    """A parsed ``--skew``: kind is zipf, dirichlet, uniform or file; value the exponent / concentration."""

    kind: str
    value: float | None = None
    path: Path | None = None

    def describe(self) -> str:
        return str(self.path) if self.kind == "file" else (f"{self.kind}:{self.value:g}" if self.value is not None else self.kind)


def parse_skew(text: str) -> Skew:
    """``zipf:1.2`` / ``dirichlet:0.3`` / ``uniform`` / a file path -> Skew; anything else is a PiperError."""
    kind, sep, value = text.partition(":")
    if kind in ("zipf", "dirichlet") and sep:
        number = _parse_float(value, text)
        if (kind == "zipf" and number < 0) or (kind == "dirichlet" and number <= 0):
            raise PiperError(f"--skew {text!r}: {kind} needs {'S >= 0' if kind == 'zipf' else 'A > 0'}; allowed {SKEW_HELP}")
        return Skew(kind, number)
    if text == "uniform":
        return Skew("uniform")
    if not text.strip():
        raise PiperError(f"--skew is empty; allowed {SKEW_HELP}")
    path = Path(text)
    if path.suffix in (".jsonl", ".json") or path.exists():
        return Skew("file", path=path)
    raise PiperError(f"--skew {text!r} is neither a distribution nor an existing file; allowed {SKEW_HELP}")


def _parse_float(value: str, text: str) -> float:
    if not DECIMAL.fullmatch(value):
        raise PiperError(f"--skew {ascii(text)}: {ascii(value)} is not a number (plain ASCII decimal, e.g. 1.2 or "
                         f"1e-3); allowed {SKEW_HELP}")
    number = float(value)
    if not np.isfinite(number):
        raise PiperError(f"--skew {text!r}: value must be finite; allowed {SKEW_HELP}")
    return number


def zipf_loads(num_experts: int, exponent: float, num_layers: int, rng: np.random.Generator,
               tokens: float = DEFAULT_TOKENS_PER_LAYER) -> np.ndarray:
    """Expected loads ``[L, E]``: the i-th most popular expert gets a share proportional to 1 / i^exponent
    (Zipf's law); which expert is the i-th is a fresh random permutation per layer."""
    with np.errstate(over="ignore"):      # i^S beyond a float: its share is 0 (S = 1e308 is allowed, if extreme)
        shares = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** exponent
    shares /= shares.sum()
    return np.stack([tokens * shares[rng.permutation(num_experts)] for _ in range(num_layers)])


def dirichlet_loads(num_experts: int, alpha: float, num_layers: int, rng: np.random.Generator,
                    tokens: float = DEFAULT_TOKENS_PER_LAYER) -> np.ndarray:
    """Loads ``[L, E]`` with shares drawn from a symmetric Dirichlet(alpha): small alpha = strong skew."""
    return tokens * rng.dirichlet(np.full(num_experts, alpha), size=num_layers)


def synthetic_loads(skew: Skew, num_experts: int, num_layers: int, seed: int) -> np.ndarray:
    """Loads ``[L, E]`` for a zipf / dirichlet / uniform Skew."""
    rng = np.random.default_rng(seed)
    if skew.kind == "zipf":
        return zipf_loads(num_experts, skew.value, num_layers, rng)
    if skew.kind == "dirichlet":
        return dirichlet_loads(num_experts, skew.value, num_layers, rng)
    assert skew.kind == "uniform", skew
    return np.full((num_layers, num_experts), DEFAULT_TOKENS_PER_LAYER / num_experts)


# ---- measured loads -------------------------------------------------------------------------------------
def read_metrics_loads(path: str | Path, last_steps: int | None = None) -> np.ndarray:
    """Sum of ``expert_tokens`` over the steps of a runtime ``metrics.jsonl`` -> float ``[L, E]``.

    ``expert_tokens`` is a list (one entry per MoE layer, in layer order) of per-expert counts indexed by
    logical expert id, or a mapping from layer index to such a list. Lines without it are skipped;
    ``last_steps`` keeps only the last N lines that carry it.
    """
    path = Path(path)
    rows = [_layer_rows(obj, path, line) for line, obj in json_lines(path) if obj.get("expert_tokens") is not None]
    if not rows:
        raise PiperError("no line carries expert_tokens (a runtime metrics.jsonl with MoE layers is expected)",
                         path=str(path))
    rows = rows[-last_steps:] if last_steps else rows
    shapes = {r.shape for r in rows}
    if len(shapes) != 1:
        raise PiperError(f"expert_tokens changes shape between lines: {sorted(shapes)}", path=str(path))
    total = np.sum(rows, axis=0)
    if not total.sum(axis=1).all():
        raise PiperError(f"layer {int(np.argmin(total.sum(axis=1)))}: no token routed to any expert in the lines "
                         "read; loads need tokens", path=str(path))
    return total


MAX_TOKEN_COUNT = 2**53
"""Largest token count of one expert in one line: a whole number a float64 holds exactly (the sums over lines stay
finite)."""


def _layer_rows(obj: dict, path: Path, line: int) -> np.ndarray:
    """One line's expert_tokens -> float ``[L, E]``; a PiperError names the first entry that is not a token count."""
    layers = _layer_list(obj["expert_tokens"], path, line)
    if all(map(_plain_counts, layers)) and len(set(map(len, layers))) == 1:
        rows = np.asarray(layers, dtype=np.float64)
        if (rows == np.floor(rows)).all():
            return rows
    raise _first_bad_count(layers, path, line)


LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,8}")
"""A layer index as piper's runtime writes it (the MoE layer's global index: "3", "4", ... for DeepSeek-V3; an MTP
module's is num_layers + k): plain decimal, so "03" and "3" cannot both name layer 3."""


def _layer_list(tokens, path: Path, line: int) -> list:
    """expert_tokens' layers in layer order: a non-empty list, or a mapping from layer index to a layer (the runtime's
    records: keys the MoE layers' global indices, in any order)."""
    if not tokens or not isinstance(tokens, (list, dict)):
        raise PiperError(f"line {line}: field expert_tokens: {_shown(tokens)} is not [layers][experts] token counts; "
                         'allowed: a non-empty list of layers, or a mapping from layer index ("0", "1", ...) to a '
                         "layer", path=str(path))
    if isinstance(tokens, list):
        return tokens
    stray = [key for key in tokens if not LAYER_KEY.fullmatch(key)]
    if stray:
        raise PiperError(f"line {line}: field expert_tokens: layer key {json.dumps(stray[0])} is not a layer index; "
                         'allowed: a layer index in plain decimal ("0", "3", "12"; no sign, space or leading zero)',
                         path=str(path))
    return [tokens[key] for key in sorted(tokens, key=int)]


def _plain_counts(counts) -> bool:
    """Whether ``counts`` is a non-empty list of JSON numbers 0 .. MAX_TOKEN_COUNT (C loops: metrics are large)."""
    return (isinstance(counts, list) and bool(counts) and set(map(type, counts)) <= {int, float}
            and min(counts) >= 0 and max(counts) <= MAX_TOKEN_COUNT)


def _is_count(value) -> bool:
    return type(value) in (int, float) and 0 <= value <= MAX_TOKEN_COUNT and float(value).is_integer()


def _first_bad_count(layers: list, path: Path, line: int) -> PiperError:
    """The error for the first layer or entry of ``layers`` that is not a list of whole token counts."""
    at = f"line {line}: field expert_tokens"
    for i, counts in enumerate(layers):
        if not isinstance(counts, list) or not counts:
            return PiperError(f"{at}[{i}]: {_shown(counts)} is not a list of token counts; allowed: [layers][experts] "
                              "whole token counts, 0 to 2^53", path=str(path))
        for j, value in enumerate(counts):
            if not _is_count(value):
                return PiperError(f"{at}[{i}][{j}]: {_shown(value)} is not a token count; allowed: whole token "
                                  "counts, 0 to 2^53", path=str(path))
        if len(counts) != len(layers[0]):
            return PiperError(f"{at}[{i}]: {len(counts)} experts, layer 0 has {len(layers[0])}; allowed: the same "
                              "number of experts in every layer", path=str(path))
    return PiperError(f"{at}: allowed: [layers][experts] whole token counts, 0 to 2^53", path=str(path))


def _shown(value, limit: int = 40) -> str:
    """``value`` as JSON, cut to ``limit`` characters (an error line stays short)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
