"""Every file piper reads or writes goes through here: the input boundary (limits, encodings, strict YAML / JSON)
and atomic writes (write a temp file, then rename).

Reading (``read_text``, ``read_document``, ``json_lines``, ``parse_json``, ``parse_yaml``) refuses, as one PiperError
line naming the file and where: a file larger than its limit (checked before reading it), text that is not UTF-8,
nesting deeper than ``MAX_DEPTH``, a document of more than ``MAX_ITEMS`` values, an integer of more than
``MAX_INT_DIGITS`` digits, NaN or infinity, duplicate mapping keys, non-string keys, YAML aliases (a few bytes
can expand to gigabytes), YAML tags beyond the plain JSON types and YAML 1.1-only number and boolean spellings
(010 octal, 0x200, 5_12, 8:32, yes / off). What comes back is plain JSON data (dict,
list, str, int, float, bool, None), checked before any schema looks at it. The limits are in
docs/design-notes.md ("Input limits").
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

from piper_plan.errors import PiperError

MAX_DOCUMENT_BYTES = 8 * 2**20
"""Largest JSON document (plan.json, a Hugging Face config.json): 8 MiB."""
MAX_YAML_BYTES = 256 * 2**10
"""Largest YAML document (a model or platform spec, a validation dataset; the largest piper ships is 35 KB): 256 KiB.
PyYAML's pure-Python parser (the strict loader's fallback where PyYAML lacks libyaml) reads a short-item list at
about 15 s per MiB."""
MAX_FILE_BYTES = 128 * 2**20
"""Largest line-oriented file (metrics.jsonl, an nccl-tests log, a calibration CSV): 128 MiB."""
MAX_DEPTH = 32
"""Deepest nesting of mappings / lists in a document (piper's own formats need 6)."""
MAX_ITEMS = 1_000_000
"""Most values (scalars, lists, mappings) in one document."""
MAX_INT_DIGITS = 24
"""Longest integer literal (10^24 is beyond every count piper uses; Python refuses 4,300 digits itself)."""


# ---- reading ------------------------------------------------------------------------------------------
def read_text(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> str:
    """A UTF-8 text file's contents; missing, a directory, too large, unreadable or not UTF-8 is one PiperError."""
    path = Path(path)
    check_regular_file(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise PiperError(f"file is {size:,} bytes; the limit is {max_bytes:,}", path=str(path))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PiperError(f"cannot read: {exc.strerror or exc}", path=str(path)) from None
    return decode_utf8(data, str(path))


def check_regular_file(path: Path, field: str | None = None) -> None:
    """One PiperError unless ``path`` is a regular file (opening a FIFO would block; a directory or device is no
    input file)."""
    if path.is_dir():
        raise PiperError("is a directory; expected a file", path=str(path), field=field)
    if not path.is_file():
        raise PiperError(_not_a_file(path), path=str(path), field=field)


def _not_a_file(path: Path) -> str:
    """Why ``path`` (not a directory, not a regular file) cannot be read: missing, a link loop or dangling link, or
    something else (a device, a FIFO, a socket)."""
    if path.is_symlink() and not path.exists():
        try:
            path.resolve(strict=True)
        except RuntimeError:           # Python < 3.13 raises RuntimeError for a loop
            return "a symbolic link loop; expected a file"
        except OSError as exc:         # Python >= 3.13: OSError with errno ELOOP
            if exc.errno == errno.ELOOP:
                return "a symbolic link loop; expected a file"
        return "a symbolic link to nothing; expected a file"
    if path.exists():
        return "not a regular file (a device, FIFO or socket); expected a file"
    return "file not found"


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark dropped); NUL bytes or other encodings are refused."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise PiperError(f"line {line}: not a UTF-8 text file (byte {exc.start}: {data[exc.start:exc.start + 1]!r})",
                         path=where) from None
    if "\x00" in text:
        raise PiperError(f"line {text[:text.index(chr(0))].count(chr(10)) + 1}: NUL byte; not a text file", path=where)
    return text


def read_document(path: str | Path) -> dict:
    """A YAML or JSON file (by suffix: .json is JSON) parsed into a mapping of plain JSON data."""
    path = Path(path)
    is_json = path.suffix == ".json"
    text = read_text(path, MAX_DOCUMENT_BYTES if is_json else MAX_YAML_BYTES)
    data = parse_json(text, str(path)) if is_json else parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise PiperError(f"expected a mapping at the top level, got {_kind(data)}", path=str(path))
    return data


def json_lines(path: str | Path, torn_tail: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-empty line of a JSON-lines file; each line is parsed by ``parse_json``.
    ``torn_tail``: a last line without its newline that does not parse (a write its writer did not finish) is
    skipped, not an error."""
    path = Path(path)
    text = read_text(path)
    lines = text.splitlines()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if torn_tail and number == len(lines) and not text.endswith("\n"):
            try:
                parse_json(raw, str(path), line=number)
            except PiperError:
                return
        obj = parse_json(raw, str(path), line=number)
        if not isinstance(obj, dict):
            raise PiperError(f"line {number}: expected a JSON object, got {_kind(obj)}", path=str(path))
        yield number, obj


def parse_json(text: str, where: str, line: int | None = None) -> Any:
    """Strict JSON: no NaN / Infinity, no duplicate keys, integers of at most MAX_INT_DIGITS digits, bounded depth."""
    at = f"line {line}: " if line is not None else ""
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_int=_parse_int, parse_float=_parse_float,
                          object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as exc:
        pos = f"line {exc.lineno}, column {exc.colno}" if line is None else f"column {exc.colno}"
        raise PiperError(f"{at}malformed JSON at {pos}: {exc.msg}", path=where) from None
    except RecursionError:
        raise PiperError(f"{at}nested deeper than {MAX_DEPTH} levels", path=where) from None
    except _Refused as exc:
        raise PiperError(f"{at}{exc}", path=where) from None
    check_tree(data, where, at)
    return data


class _Refused(ValueError):
    """A value the strict parsers refuse (raised inside the parser hooks, turned into a PiperError outside)."""


def _refuse_constant(name: str):
    raise _Refused(f"{name} is not a number piper accepts (finite numbers only)")


def ascii_int(text: str, max_digits: int = 18) -> int:
    """An integer typed on a command line: ASCII digits only (``int`` also takes '1_0', '١٦' and '１６'), at most
    ``max_digits`` of them; ValueError else."""
    stripped = text.strip()
    if not re.fullmatch(rf"[+-]?[0-9]{{1,{max_digits}}}", stripped):
        raise ValueError(f"not an integer: {text!r}")
    return int(stripped)


def ascii_float(text: str) -> float:
    """A decimal number typed on a command line: ASCII digits, an optional fraction and exponent (``float`` also
    takes '1_0', '１', 'nan' and 'inf'), finite; ValueError else."""
    stripped = text.strip()
    if not re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?", stripped):
        raise ValueError(f"not a number: {text!r}")
    value = float(stripped)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(digits.lstrip('-')):,} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(digits)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"{text[:40]} is not a finite number")
    return value


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {key!r}")
        out[key] = value
    return out


def check_tree(data: Any, where: str, at: str = "") -> None:
    """Depth, size, finite floats and string keys of parsed data (iterative: no recursion to exhaust)."""
    stack, items = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > MAX_ITEMS:
            raise PiperError(f"{at}more than {MAX_ITEMS:,} values in one document", path=where)
        if isinstance(node, (dict, list)) and depth > MAX_DEPTH:
            raise PiperError(f"{at}nested deeper than {MAX_DEPTH} levels", path=where)
        if isinstance(node, dict):
            bad = next((k for k in node if not isinstance(k, str)), None)
            if bad is not None:
                raise PiperError(f"{at}mapping key {bad!r} is not a string", path=where)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, float) and not math.isfinite(node):
            raise PiperError(f"{at}{node} is not a finite number", path=where)
        elif not isinstance(node, (str, int, float, bool, type(None))):
            raise PiperError(f"{at}a {type(node).__name__} value; only strings, numbers, booleans, null, lists and "
                             "mappings are accepted", path=where)


def parse_yaml(text: str, where: str) -> Any:
    """Strict YAML (see the module docstring); errors name the line and column."""
    import yaml

    c_loader, python_loader = _strict_loader_classes()
    use_c = c_loader is not None and _utf8_encodable(text)
    loader = None
    try:
        if use_c:
            _refuse_aliases_and_depth(c_loader(text))
        loader = (c_loader if use_c else python_loader)(text)     # PyYAML's reader checks the characters here
        data = loader.get_single_data()
    except _Refused as exc:
        raise PiperError(str(exc), path=where) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if problem == "exceeded maximum nesting depth":     # libyaml's scanner, at 1,000 flow levels
            line = f"line {mark.line + 1}: " if mark else ""
            raise PiperError(f"{line}nested deeper than {MAX_DEPTH} levels", path=where) from None
        raise PiperError(f"malformed YAML{at}: {problem}", path=where) from None
    except RecursionError:
        raise PiperError(f"nested deeper than {MAX_DEPTH} levels", path=where) from None
    finally:
        if loader is not None:
            loader.dispose()
    check_tree(data, where)
    return data


def python_only_number(text: str) -> bool:
    """Whether ``text`` is a number only Python's float() / int() read: digit-group underscores (4_5.12 is 45.12)
    or non-ASCII digits (Arabic-Indic); no tool that writes numbers (nccl-tests, csv writers) prints them."""
    return "_" in text or not text.isascii()


_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""1e12 without a dot: a float in YAML 1.2 and JSON, a string in PyYAML's YAML 1.1 resolver; read as a float."""
_DECIMAL_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
"""The integers YAML 1.2 and JSON write: PyYAML's YAML 1.1 resolver also reads 010 as 8 (octal), 0x200, 0b1,
5_12 and 8:32 (base 60) as 512; piper refuses those spellings rather than guess which was meant."""
_BOOLS = ("true", "false", "True", "False", "TRUE", "FALSE")
"""YAML 1.2's booleans; YAML 1.1 also reads yes / no / on / off as booleans (refused: write true or false)."""


def _utf8_encodable(text: str) -> bool:
    """Whether libyaml's parser can take ``text`` (it reads UTF-8; a lone surrogate is not encodable, and the
    pure-Python reader refuses it in one line)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_aliases_and_depth(events) -> None:
    """The pure-Python loader's composer checks (no alias, no node deeper than ``MAX_DEPTH``), run over libyaml's
    event stream before its composer (C recursion, which the checks keep shallow) builds the nodes."""
    from yaml.events import AliasEvent, CollectionEndEvent, CollectionStartEvent, ScalarEvent

    depth = 0
    try:
        while (event := events.get_event()) is not None:
            if isinstance(event, AliasEvent):
                raise _Refused(f"line {event.start_mark.line + 1}: YAML aliases (*name) are not accepted; "
                               "write the value out")
            if isinstance(event, (CollectionStartEvent, ScalarEvent)) and depth + 1 > MAX_DEPTH:
                raise _Refused(f"line {event.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
            depth += isinstance(event, CollectionStartEvent) - isinstance(event, CollectionEndEvent)
    finally:
        events.dispose()


def _strict_loader_classes():
    """(libyaml-backed loader or None, pure-Python loader), built once: SafeLoader subclasses that refuse what the
    module docstring lists. libyaml's parser and composer read about 7x faster than PyYAML's (platforms/frontier.yaml:
    1.0 against 7.0 ms); its composer is C, so the alias and depth checks run over its events first
    (``_refuse_aliases_and_depth``); where PyYAML was built without libyaml, the pure-Python loader reads alone."""
    global _STRICT_LOADERS
    if _STRICT_LOADERS is not None:
        return _STRICT_LOADERS
    import yaml
    from yaml.events import AliasEvent

    class StrictConstruction:
        """The constructor and resolver rules both loaders share."""

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, str):
                    raise _Refused(f"line {key_node.start_mark.line + 1}: mapping key {key!r} is not a string")
                if key in seen:
                    raise _Refused(f"line {key_node.start_mark.line + 1}: duplicate key {key!r} "
                                   f"(first at line {seen[key]})")
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_int(self, node):
            if not _DECIMAL_INT.fullmatch(node.value):
                raise _Refused(f"line {node.start_mark.line + 1}: {node.value} is a YAML 1.1 integer spelling "
                               "(octal, hex, binary, base 60 or with '_'); write it in plain decimal")
            digits = sum(ch.isdigit() for ch in node.value)
            if digits > MAX_INT_DIGITS:
                raise _Refused(f"line {node.start_mark.line + 1}: an integer of {digits:,} digits; at most "
                               f"{MAX_INT_DIGITS} are accepted")
            return super().construct_yaml_int(node)

        def construct_yaml_bool(self, node):
            if node.value not in _BOOLS:
                raise _Refused(f"line {node.start_mark.line + 1}: {node.value} is a YAML 1.1 boolean spelling; "
                               "write true or false (or quote it, for a string or a key)")
            return super().construct_yaml_bool(node)

        def construct_yaml_float(self, node):
            if "_" in node.value or ":" in node.value:
                raise _Refused(f"line {node.start_mark.line + 1}: {node.value} is a YAML 1.1 number spelling (with "
                               "'_' or base 60); write it in plain decimal")
            value = super().construct_yaml_float(node)
            if not math.isfinite(value):
                raise _Refused(f"line {node.start_mark.line + 1}: {node.value} is not a finite number")
            return value

        def construct_undefined(self, node):
            raise _Refused(f"line {node.start_mark.line + 1}: YAML tag {node.tag} is not accepted")

    class StrictLoader(StrictConstruction, yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            if self.check_event(AliasEvent):
                mark = self.peek_event().start_mark
                raise _Refused(f"line {mark.line + 1}: YAML aliases (*name) are not accepted; write the value out")
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    mark = self.peek_event().start_mark
                    raise _Refused(f"line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loaders = [StrictLoader]
    if yaml.__with_libyaml__:
        loaders.insert(0, type("CStrictLoader", (StrictConstruction, yaml.CSafeLoader), {}))
    for loader in loaders:
        loader.add_constructor("tag:yaml.org,2002:int", StrictConstruction.construct_yaml_int)
        loader.add_constructor("tag:yaml.org,2002:float", StrictConstruction.construct_yaml_float)
        loader.add_constructor("tag:yaml.org,2002:bool", StrictConstruction.construct_yaml_bool)
        for tag in ("timestamp", "binary", "set", "omap", "pairs"):      # not JSON types: refused, not converted
            loader.add_constructor(f"tag:yaml.org,2002:{tag}", StrictConstruction.construct_undefined)
        loader.add_constructor(None, StrictConstruction.construct_undefined)
        loader.yaml_implicit_resolvers = {
            first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
        loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
    _STRICT_LOADERS = (loaders[0] if len(loaders) == 2 else None, StrictLoader)
    return _STRICT_LOADERS


_STRICT_LOADERS = None


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), f"a {type(value).__name__}")


# ---- writing ------------------------------------------------------------------------------------------


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a reader sees the old file or the new one, never half.

    Missing parent folders are created. An OS error (read-only folder, a file where a folder is needed,
    full disk) becomes one PiperError line naming the path; nothing is left behind.
    """
    return atomic_write_bytes(path, text.encode("utf-8"))


def check_writable(path: str | Path) -> None:
    """Raise a PiperError now if ``path`` cannot be written later (commands call it before long work)."""
    path = _link_target(Path(path))
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise PiperError(f"cannot write: {blocker} is a file, not a folder", path=str(path))
    if path.is_dir():
        raise PiperError("cannot write: is a directory; give a file name", path=str(path))
    if path.exists() and not path.is_file():   # a device, FIFO or socket: the atomic rename would replace it
        raise PiperError("cannot write: not a regular file (a device, pipe or socket); give a file name",
                         path=str(path))
    existing = next(p for p in (path, *path.parents) if p.exists())
    folder = existing if existing.is_dir() else existing.parent
    if not os.access(folder, os.W_OK | os.X_OK) or (existing == path and not os.access(path, os.W_OK)):
        raise PiperError(f"cannot write: {existing} is not writable", path=str(path))


def check_folder_path(folder: str | Path, field: str | None = None) -> None:
    """A folder a command will make (or write into) can be made: no symbolic link to nothing or link loop on its
    path (mkdir cannot make a folder through one; the error came after the work, or from each rank), and no file
    where it or one of its parents should be a folder."""
    folder = Path(folder)
    for part in (folder, *folder.parents):
        if part.is_symlink() and not part.exists():
            raise PiperError(f"cannot make this folder: {part} is a symbolic link to nothing or a link loop",
                             path=str(folder), field=field)
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise PiperError(f"cannot make this folder: {blocker} is a file, not a folder", path=str(folder), field=field)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (``atomic_write_text``'s rules; a PNG, say). A symbolic link is
    written through (its target replaced, the link kept); a path in /dev, /proc or /sys is refused."""
    given = Path(path)
    check_writable(given)
    try:
        _write_replace(_link_target(given), data)
    except OSError as exc:
        raise PiperError(f"cannot write: {exc.strerror or exc}", path=str(given)) from None
    return given


SYSTEM_FOLDERS = ("/dev", "/proc", "/sys")
"""Folders whose entries are devices and kernel files: never an output (an atomic rename over /dev/stdout replaced
the system's link with a plain file), except under SHARED_MEMORY."""
SHARED_MEMORY = Path("/dev/shm")
"""A tmpfs of ordinary files and folders under /dev: outputs there are written as anywhere."""


def _link_target(path: Path) -> Path:
    """The file ``path`` names once its symbolic links are followed; a system folder's entry is one error line."""
    hops, where = [Path(os.path.abspath(path))], Path(os.path.abspath(path))
    while where.is_symlink():                             # each link on the way (/dev/stdout -> /proc/self/fd/1)
        where = Path(os.path.abspath(where.parent / os.readlink(where)))
        if where in hops or len(hops) >= 40:              # the kernel's own limit on links followed is 40
            raise PiperError("cannot write: a symbolic link loop; give a file name", path=str(path))
        hops.append(where)
    resolved = Path(os.path.realpath(path))
    for hop in hops + [resolved]:
        if SHARED_MEMORY in hop.parents:
            continue
        if any(hop == Path(f) or Path(f) in hop.parents for f in SYSTEM_FOLDERS):
            raise PiperError(f"cannot write: {hop} is a device or kernel file; give a file name", path=str(path))
    return resolved if path.is_symlink() else path


def _write_replace(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())               # mkstemp's 0600 -> what open() would have made
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
