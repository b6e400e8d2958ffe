"""Find and load specs by catalog name or by path: models/*.yaml, platforms/*.yaml.

The catalog folders sit at the project root (beside ``piper_plan/`` in a source checkout; inside it, as
``piper_plan/_home/``, where a wheel installed it: setup.py); ``PIPER_HOME`` points elsewhere.
Every load error becomes one PiperError line naming the file, the field and what is allowed.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from piper_plan import fileio
from piper_plan.errors import PiperError
from piper_plan.specs import ModelSpec, PlatformSpec

SpecT = TypeVar("SpecT", bound=BaseModel)


SHIPPED_HOME = "_home"
"""The folder inside the package where a wheel's build put the catalog folders (setup.py)."""


def project_root() -> Path:
    """The folder holding models/, platforms/, calibration/ and validation/: PIPER_HOME where set, else the one
    piper was installed with (``shipped_root``)."""
    env = os.environ.get("PIPER_HOME")
    return Path(env) if env else shipped_root()


@functools.cache
def shipped_root() -> Path:
    """The source checkout beside the package (an editable install: its pyproject.toml and models/ are there),
    else the copy a wheel installed inside the package (piper_plan/_home/), else the checkout (whose missing folder
    is then named). Not models/ alone: site-packages may hold another project's top-level models/."""
    package = Path(__file__).resolve().parent
    if in_checkout() or not (package / SHIPPED_HOME).is_dir():
        return package.parent
    return package / SHIPPED_HOME


@functools.cache
def in_checkout() -> bool:
    """Whether piper runs from its source checkout (pyproject.toml and models/ beside the package), not a wheel."""
    root = Path(__file__).resolve().parent.parent
    return (root / "pyproject.toml").is_file() and (root / "models").is_dir()


def report_root() -> Path:
    """Where a report's default path (docs/...) is: the checkout's root, else the working directory (a wheel's
    package is no place for a user's reports)."""
    return project_root() if os.environ.get("PIPER_HOME") or in_checkout() else Path.cwd()


def models_dir() -> Path:
    return project_root() / "models"


def platforms_dir() -> Path:
    return project_root() / "platforms"


def calibration_dir(platform: str) -> Path:
    return project_root() / "calibration" / platform


def has_calibration(platform: str) -> bool:
    """Whether calibration/<platform>/ holds any CSV, looked at before pandas and scipy are imported; a folder that
    cannot be listed (no permission) is an OSError, one line, not an empty calibration (before: its plans were
    priced from the roofline fallback without a word)."""
    directory = calibration_dir(platform)
    return directory.is_dir() and any(name.endswith(".csv") for name in os.listdir(directory))


def catalog_names(folder: Path) -> list[str]:
    """Names of the YAML specs in ``folder``, sorted."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def required_names(folder: Path, kind: str) -> list[str]:
    """``catalog_names`` of a catalog folder that must hold some (models/, platforms/, validation/): one error line
    where it holds none, naming the folder and where it comes from (PIPER_HOME, a typo there, reads as an empty
    catalog, and `piper validate` passed with no dataset checked)."""
    names = catalog_names(folder)
    if names:
        return names
    home = os.environ.get("PIPER_HOME")
    state = "holds no *.yaml" if folder.is_dir() else "does not exist"
    if home:
        raise PiperError(f"{folder} {state}: the {kind} catalog folder (PIPER_HOME={home}); allowed: a folder "
                         f"holding piper's {kind} files (unset PIPER_HOME to use the ones piper ships)")
    raise PiperError(f"{folder} {state}: the {kind} catalog folder piper was installed with; allowed: a source "
                     f"checkout's {kind} files, or a wheel built from one (pip install . copies them into the "
                     f"package), or PIPER_HOME naming a folder that holds them")


def read_text(path: Path) -> str:
    """A text file's contents through the input boundary (``fileio.read_text``)."""
    return fileio.read_text(path)


def read_structured(path: Path) -> dict:
    """A YAML or JSON file as a mapping of plain JSON data (``fileio.read_document``: limits, strict parsing)."""
    return fileio.read_document(path)


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _loc_part(part) -> str:
    """A field name as it is, any other key (empty, spaces, a newline) quoted so the message stays one line."""
    text = str(part)
    return text if _PLAIN_KEY.fullmatch(text) else repr(text)


def validation_message(exc: ValidationError) -> str:
    """Render a pydantic error as 'field.path: message (got value)' for each problem, on one line."""
    parts = []
    for err in exc.errors():
        loc = ".".join(_loc_part(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        unknown = err["type"] in ("extra_forbidden", "unexpected_keyword_argument")   # a spec's, a dataclass's
        if unknown:
            msg = "unknown field"
        elif isinstance(got, bool) and err["type"] in ("int_type", "float_type", "int_from_float"):
            msg = "a boolean is not a number"
        elif err["type"] == "model_type":       # "... or instance of StageMemory": a class name the user never wrote
            msg = "Input should be an object (a mapping of field names to values)"
        shown = "" if isinstance(got, (dict, list)) or unknown or err["type"] == "missing" else f" (got {got!r})"
        parts.append(f"{loc}: {msg}{shown}" if err["loc"] else f"{msg}{shown}")
    return "; ".join(parts)


def parse_spec(cls: type[SpecT], data: dict, path: str, field: str | None = None) -> SpecT:
    """Validate ``data`` as ``cls`` (a spec, or a dataclass such as CostOptions over its annotations) in pydantic's
    strict JSON mode (a boolean is not a number, a string is not a number, 4.0 is not an integer); a validation
    failure is one PiperError line naming the file and, where given, the ``field`` ``data`` came from (a
    dataclass's own check raising a PiperError keeps the field it names).

    ``data`` is what ``read_structured`` returns (plain JSON data); anything else (objects built in code) is
    validated as it is."""
    try:
        text = json.dumps(data, allow_nan=False)
    except (TypeError, ValueError):
        text = None
    try:
        if isinstance(cls, type) and issubclass(cls, BaseModel):
            return cls.model_validate(data) if text is None else cls.model_validate_json(text, strict=True)
        adapter = _type_adapter(cls)
        return adapter.validate_python(data) if text is None else adapter.validate_json(text, strict=True)
    except ValidationError as exc:
        raise PiperError(validation_message(exc), path=path or None, field=field) from None


@functools.cache
def _type_adapter(cls):
    """pydantic's validator of a dataclass, built once per class (building it takes milliseconds: CostOptions 3.6)."""
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def resolve(name_or_path: str, folder: Path, kind: str) -> Path:
    """A catalog name -> its YAML file; an existing path (or one ending in .yaml/.json) is used as it is."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml", ".json") or os.sep in name_or_path:
        return candidate
    path = folder / f"{name_or_path}.yaml"
    if path.is_file():
        return path
    names = required_names(folder, kind)
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
    data = read_structured(path)
    if isinstance(data, dict) and {"schema_version", "platform", "parallel"} <= data.keys():
        raise PiperError("a plan file, not a platform file; allowed: a platform name or a platform file (a plan's "
                         "platform is its 'platform' block)", path=str(path))
    return parse_spec(PlatformSpec, data, str(path))


def list_models() -> list[ModelSpec]:
    return [load_model(n) for n in required_names(models_dir(), "model")]


def list_platforms() -> list[PlatformSpec]:
    return [load_platform(n) for n in required_names(platforms_dir(), "platform")]


def spec_to_yaml(spec: BaseModel) -> str:
    """A spec as YAML, defaults left out, in field order."""
    data = spec.model_dump(mode="json", exclude_defaults=True)
    return yaml.safe_dump(data, sort_keys=False, width=110)


def spec_text(spec: BaseModel, path: str | Path | None) -> str:
    """A spec as the file ``path`` names: JSON for a .json file (the loaders read it by its suffix), else YAML (also
    for ``path`` None: stdout)."""
    if path is not None and Path(path).suffix.lower() == ".json":
        import json

        return json.dumps(spec.model_dump(mode="json", exclude_defaults=True), indent=2) + "\n"
    return spec_to_yaml(spec)
