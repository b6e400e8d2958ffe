"""``piper export``: the same model and degrees as a plan.json, as a launch for another training engine.

Pure rendering (no torch, no I/O): ``render(plan_file, engine)`` returns the job script's text. Each engine module
maps piper's plan onto the engine's own options and refuses, as one PiperError line, what the engine cannot
express (a model it has no configuration for, a degree it does not have). Every script's header says what only
piper's runtime does and what the engine uses instead (``script.piper_only``).
"""

from __future__ import annotations

from piper_plan.errors import PiperError

ENGINES = ("torchtitan", "megatron")


def render(plan_file, engine: str) -> str:
    """The job script (bash) that runs ``plan_file``'s model and degrees under ``engine``."""
    if engine == "torchtitan":
        from piper_plan.export.torchtitan import script
    elif engine == "megatron":
        from piper_plan.export.megatron import script
    else:
        raise PiperError(f"engine {engine!r}; allowed: {', '.join(ENGINES)}", field="--engine")
    return script(plan_file)
