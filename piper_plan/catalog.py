"""Find and load specs by catalog name or by path: models/*.yaml, platforms/*.yaml.

The catalog folders sit at the project root (beside ``piper_plan/``); ``PIPER_HOME`` points elsewhere.
Every load error becomes one PiperError line naming the file, the field and what is allowed.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from piper_plan.errors import PiperError
from piper_plan.specs import ModelSpec, PlatformSpec

SpecT = TypeVar("SpecT", bound=BaseModel)


def project_root() -> Path:
    """The folder holding models/, platforms/ and calibration/ (PIPER_HOME, else beside the package)."""
    env = os.environ.get("PIPER_HOME")
    return Path(env) if env else Path(__file__).resolve().parent.parent


def models_dir() -> Path:
    return project_root() / "models"


def platforms_dir() -> Path:
    return project_root() / "platforms"


def calibration_dir(platform: str) -> Path:
    return project_root() / "calibration" / platform


def catalog_names(folder: Path) -> list[str]:
    """Names of the YAML specs in ``folder``, sorted."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def read_text(path: Path) -> str:
    """A text file's contents; a missing, unreadable, binary or directory path is one PiperError line."""
    if path.is_dir():
        raise PiperError("is a directory; expected a file", path=str(path))
    if not path.is_file():
        raise PiperError("file not found", path=str(path))
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PiperError(f"not a UTF-8 text file (byte {exc.start})", path=str(path)) from None
    except OSError as exc:
        raise PiperError(f"cannot read: {exc.strerror or exc}", path=str(path)) from None


def read_structured(path: Path) -> dict:
    """Parse a YAML or JSON file into a mapping; errors name the file and line."""
    text = read_text(path)
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise PiperError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}", path=str(path)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PiperError(f"malformed YAML{where}: {problem}", path=str(path)) from None
    if not isinstance(data, dict):
        raise PiperError(f"expected a mapping at the top level, got {type(data).__name__}", path=str(path))
    return data


def validation_message(exc: ValidationError) -> str:
    """Render a pydantic error as 'field.path: message (got value)' for each problem, on one line."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) or err["type"] in ("missing", "extra_forbidden") else f" (got {got!r})"
        parts.append(f"{loc}: {msg}{shown}")
    return "; ".join(parts)


def parse_spec(cls: type[SpecT], data: dict, path: str) -> SpecT:
    """Validate ``data`` as ``cls``; a validation failure is one PiperError line naming the file."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise PiperError(validation_message(exc), path=path) from None


def resolve(name_or_path: str, folder: Path, kind: str) -> Path:
    """A catalog name -> its YAML file; an existing path (or one ending in .yaml/.json) is used as it is."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml", ".json") or os.sep in name_or_path:
        return candidate
    path = folder / f"{name_or_path}.yaml"
    if path.is_file():
        return path
    names = catalog_names(folder)
    close = difflib.get_close_matches(name_or_path, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(names)}"
    raise PiperError(f"unknown {kind} {name_or_path!r}{hint}")


def load_model(name_or_path: str) -> ModelSpec:
    """A ModelSpec from a catalog name (mixtral-8x7b) or a YAML/JSON path."""
    path = resolve(name_or_path, models_dir(), "model")
    return parse_spec(ModelSpec, read_structured(path), str(path))


def load_platform(name_or_path: str) -> PlatformSpec:
    """A PlatformSpec from a catalog name (frontier) or a YAML/JSON path."""
    path = resolve(name_or_path, platforms_dir(), "platform")
    return parse_spec(PlatformSpec, read_structured(path), str(path))


def list_models() -> list[ModelSpec]:
    return [load_model(n) for n in catalog_names(models_dir())]


def list_platforms() -> list[PlatformSpec]:
    return [load_platform(n) for n in catalog_names(platforms_dir())]


def spec_to_yaml(spec: BaseModel) -> str:
    """A spec as YAML, defaults left out, in field order."""
    data = spec.model_dump(mode="json", exclude_defaults=True)
    return yaml.safe_dump(data, sort_keys=False, width=110)
