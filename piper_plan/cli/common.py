"""What every command shares: the result console (stdout), the diagnostics console (stderr), JSON output, and the
user-error boundary."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import click

from piper_plan.errors import EXIT_CHECK_FAILED, EXIT_USER_ERROR, PiperError  # noqa: F401 (re-exported)

EXIT_NOTHING_FITS = 3
"""``plan``: no candidate fits (the closest ones and what would make them fit are shown)."""

EXIT_STDOUT_CLOSED = 141
"""The reader of stdout left early (``piper plan | head``): a quiet exit with the status a shell gives a Unix tool
killed by SIGPIPE (128 + 13), not 1, which means a failed check."""

EXIT_CODES = {0: "ok", EXIT_USER_ERROR: "bad input (one 'error:' line on stderr)"}
"""The exit codes every command shares; ``exit_codes`` adds a command's own."""


def exit_codes(own: dict[int, str] | None = None) -> str:
    """A command's --help epilog: the shared exit codes plus the command's own (code -> meaning)."""
    codes = {**EXIT_CODES, **(own or {})}
    return "Exit codes: " + "; ".join(f"{code} {codes[code]}" for code in sorted(codes)) + "."


def console():
    """The rich Console for a command's human result (tables, reports): stdout, so that ``piper models | head``
    and ``piper plan ... > plan.txt`` capture it. ``--json`` / ``--csv`` replace it (``print_json``)."""
    return _console(stderr=False)


def diagnostics():
    """The rich Console for progress, warnings and diagnostics ("wrote X"): stderr, so stdout stays the result."""
    return _console(stderr=True)


def note(text: str) -> None:
    """One plain diagnostic line on stderr (no markup: paths and node lists are printed as they are), never wrapped
    at the terminal's width: a long path stays one line to copy or to parse ("wrote PATH")."""
    diagnostics().print(text, markup=False, soft_wrap=True)


def stdout_closed() -> None:
    """Exit quietly with EXIT_STDOUT_CLOSED; stdout goes to /dev/null so the interpreter's last flush cannot fail."""
    import os
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    if sys.stdout is not None:
        os.dup2(devnull, sys.stdout.fileno())
    sys.exit(EXIT_STDOUT_CLOSED)


@lru_cache(maxsize=2)
def _console(stderr: bool):
    import os
    import sys

    from rich.console import Console

    class PiperConsole(Console):
        def on_broken_pipe(self) -> None:      # rich's default exits 1
            stdout_closed()

    # Piped or logged output (no terminal, no COLUMNS): wide tables instead of rich's 80-column default, and lines
    # left unwrapped so that commands in messages stay copy-pasteable. Colour and live progress only on a terminal
    # (rich's own rule for a stream that is not one).
    stream = sys.stderr if stderr else sys.stdout
    if stream is None:                 # the descriptor was closed before piper started (`piper models >&-`)
        if not stderr:
            stdout_closed()
        return PiperConsole(file=open(os.devnull, "w"), highlight=False)
    environ = _environ_with_sane_columns()
    piped = not stream.isatty() and "COLUMNS" not in environ
    return PiperConsole(stderr=stderr, highlight=False, width=160 if piped else None, soft_wrap=piped,
                        _environ=environ)


MIN_COLUMNS = 20
"""The narrowest COLUMNS piper believes. Below it rich has no room for a table's borders and a character a column:
COLUMNS=0 drew nothing at all (every command's output lost, exit 0) and COLUMNS=1 one character a line. No terminal
is that narrow, so such a value is a broken setting, read as if COLUMNS were unset (the terminal's own width, or
the piped width). At 20 a line still holds a few words, and a long line wraps."""


def _environ_with_sane_columns() -> dict[str, str]:
    """os.environ as the consoles read it (rich's ``_environ``): COLUMNS left out unless it is a whole number of at
    least MIN_COLUMNS (rich itself took any isdigit() text, so '0', and crashed on '²')."""
    import os

    environ = dict(os.environ)
    columns = environ.get("COLUMNS", "")
    if not (columns.isascii() and columns.isdigit() and int(columns) >= MIN_COLUMNS):
        environ.pop("COLUMNS", None)
    return environ


def platform_show_command(platform_ref: str) -> str:
    """`piper platform show REF` for the --platform the user gave (a catalog name or a file's path), quoted."""
    import shlex

    return f"`piper platform show {shlex.quote(platform_ref)}`"


def options_given(ctx: click.Context, but: tuple[str, ...] = ()) -> list[str]:
    """The options of ``ctx``'s command the user typed (not defaults), as flags, except the parameters named in
    ``but``: for a refusal that names them."""
    from click.core import ParameterSource

    return ["/".join(p.opts + p.secondary_opts) for p in ctx.command.params if p.name not in but
            and ctx.get_parameter_source(p.name) is ParameterSource.COMMANDLINE]


def short_compute_source(text: str, platform, cited_at: str) -> str:
    """The compute-rate provenance for a human reader: the platform's efficiency citation (hundreds of characters,
    quoted whole in --json and plan files) replaced by where to read it (``cited_at``: the command or file)."""
    cited = platform.efficiency.source
    return text.replace(cited, f"cited: {cited_at}") if cited else text


PLAIN_TABLE_ROWS = 200
"""A result table with more rows than this prints as plain aligned text (``print_table``): rich lays out every cell
as a renderable, about 2 ms a row for the plan table, so ``piper plan --top 0`` on 2,048 Frontier nodes (4,500
rows) spent 9 of its 10 s drawing."""


def print_table(table, width: int | None = None) -> None:
    """A rich Table of plain-string cells on the result console, every cell whole at any width: drawn by rich where
    it fits the width (``width``, else the console's) with no cell wrapped, else as plain aligned text with the same
    title, columns, justification and caption (no colour, no box; a terminal wraps its long lines). Rich squeezed a
    table wider than the terminal by cutting cells: `piper models` at 40 columns showed 'de…' for both
    deepseek-v2 and deepseek-v3. Over PLAIN_TABLE_ROWS rows the table is plain text too (rich's layout is slow)."""
    out = console()
    if table.row_count <= PLAIN_TABLE_ROWS and _unwrapped_width(out, table) <= (width or out.width):
        out.print(table, width=width)
        return
    click.echo(plain_table_text(table))


def _unwrapped_width(out, table) -> int:
    """The width rich draws ``table`` at with no cell wrapped or cut."""
    from rich.measure import Measurement

    return Measurement.get(out, out.options.update_width(1 << 20), table).maximum


def plain_table_text(table) -> str:
    """``table`` (a rich Table whose cells are str) as aligned text: title, header, a rule (ASCII on a stream that
    is not UTF-8), rows, caption. A cell reads as rich shows it (its markup applied: an escaped '\\[' is a '[')."""
    from rich.cells import cell_len

    out = console()
    rule = "─" if out.encoding.startswith("utf") else "-"     # rich's own test for a box it may draw

    def text(value) -> str:
        return out.render_str(value).plain if isinstance(value, str) else str(value)

    columns = [(text(c.header), [text(cell) for cell in c.cells], c.justify) for c in table.columns]
    widths = [max(cell_len(header), *map(cell_len, cells)) for header, cells, _ in columns]

    def line(values) -> str:
        return "  ".join(v.ljust(w) if justify == "left" else v.rjust(w)
                         for v, w, (_, _, justify) in zip(values, widths, columns)).rstrip()

    lines = [text(table.title)] if table.title else []
    lines += [line([header for header, _, _ in columns]), "  ".join(rule * w for w in widths)]
    lines += [line(row) for row in zip(*(cells for _, cells, _ in columns))]
    return "\n".join(lines + ([text(table.caption)] if table.caption else []))


def print_json(obj: Any) -> None:
    """Machine output: one JSON document on stdout."""
    click.echo(json.dumps(obj, indent=2, default=_json_default))


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


class AliasedOption(click.Option):
    """An option whose old spellings (``hidden_aliases``) still parse, so no user script breaks, but are not shown
    in --help nor in error messages."""

    def __init__(self, *args, hidden_aliases: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.hidden_aliases = tuple(hidden_aliases)

    def _shown_only(self, render, *args):
        every = self.opts
        self.opts = [opt for opt in every if opt not in self.hidden_aliases]
        try:
            return render(*args)
        finally:
            self.opts = every

    def get_help_record(self, ctx):
        return self._shown_only(super().get_help_record, ctx)

    def get_error_hint(self, ctx) -> str:
        return self._shown_only(super().get_error_hint, ctx)


def output_option(dest: str, help: str, old: tuple[str, ...] = (), **kwargs):
    """``-o/--output FILE``: the one spelling of "write a file"; ``old`` spellings keep working, hidden. The file
    may not be one of the command's inputs (``not_an_input``)."""
    option = click.option("-o", "--output", *old, dest, cls=AliasedOption, hidden_aliases=old, metavar="FILE",
                          type=click.Path(dir_okay=False), default=None, help=help, **kwargs)
    return not_an_input(dest, "-o", option)


def not_an_input(dest: str, flag: str, option):
    """``option`` (a click option decorator writing the file named by parameter ``dest``) on a command that refuses,
    before it runs, to write over a file another of its parameters names: `estimate --model m.yaml -o m.yaml`
    would have replaced the model with a plan."""
    from functools import wraps

    OUTPUT_FLAGS[dest] = flag

    def decorate(fn):
        @wraps(fn)
        def checked(*args, **params):
            _refuse_overwriting_inputs(params, dest, flag)
            return fn(*args, **params)
        return option(checked)
    return decorate


OUTPUT_FLAGS: dict[str, str] = {}
"""Parameter name -> flag of every option that writes a file (``not_an_input``): two of them may not name one file."""

CATALOG_INPUTS = {"model": "models", "model_name": "models", "platform": "platforms", "platform_name": "platforms",
                  "datasets": "validation"}
"""Parameters that may name a catalog file (models/<name>.yaml, ...) rather than give its path."""


def _refuse_overwriting_inputs(params: dict, dest: str, flag: str) -> None:
    import os
    from pathlib import Path

    out = params.get(dest)
    if out is not None and (not str(out).strip() or str(out).endswith(("/", "\\"))):
        raise PiperError(f"{out!r} names no file (empty, or a folder's path ending in a separator); give a file name",
                         field=flag)
    if out is not None and str(out) == "-":     # not stdout: that is the command's result (--json puts it there)
        raise PiperError("'-' names no file here (stdout carries the command's result; --json prints it there); give "
                         "a file name", field=flag)
    if not out:
        return
    for name, other in OUTPUT_FLAGS.items():
        if name != dest and params.get(name) and Path(params[name]).resolve() == Path(out).resolve():
            raise PiperError(f"is also this command's {other} output: one would replace the other; give two files",
                             path=str(out), field=flag)
    if not Path(out).is_file():
        return
    for name, value in params.items():
        if name != dest and any(os.path.samefile(path, out) for path in _input_files(name, value)):
            raise PiperError(f"is also this command's {_shown(name)} input: writing would replace it; give another "
                             "file", path=str(out), field=flag)


def _shown(param: str) -> str:
    """A parameter of the running command as its user typed it: an option's flag (--plan), an argument's name."""
    ctx = click.get_current_context(silent=True)
    found = next((p for p in (ctx.command.params if ctx else ()) if p.name == param), None)
    if found is None:
        return param
    return found.opts[0] if isinstance(found, click.Option) else found.human_readable_name


def _input_files(name: str, value) -> list:
    """The existing files a parameter's value names: paths, and for CATALOG_INPUTS catalog names."""
    import os
    from pathlib import Path

    values = value if isinstance(value, (tuple, list)) else (value,)
    files = []
    for text in (v for v in values if isinstance(v, (str, os.PathLike)) and str(v)):
        path = Path(text)
        if not path.is_file() and name in CATALOG_INPUTS and not path.suffix and os.sep not in str(text):
            from piper_plan.catalog import project_root

            path = project_root() / CATALOG_INPUTS[name] / f"{text}.yaml"
        if path.is_file():
            files.append(path)
    return files


def out_dir_option(dest: str, help: str, old: tuple[str, ...] = (), **kwargs):
    """``--out-dir DIR``: the one spelling of "write into a directory"; ``old`` spellings keep working, hidden. A
    blank value is refused: it is not the default directory (calibration/<platform>/, docs/paper/) nor this one."""
    from functools import wraps

    kwargs.setdefault("type", click.Path(file_okay=False))
    if getattr(kwargs["type"], "type", None) is not None:
        raise TypeError("out_dir_option takes the directory as text (the blank check needs it): no path_type")
    option = click.option("--out-dir", *old, dest, cls=AliasedOption, hidden_aliases=old, metavar="DIR",
                          help=help, **kwargs)

    default = "" if kwargs.get("required") else " (or leave --out-dir out for the default)"

    def decorate(fn):
        @wraps(fn)
        def checked(*args, **params):
            value = params.get(dest)          # the text as given: a path_type=Path would make '' the folder '.'
            if value is not None and not str(value).strip():
                raise PiperError(f"{value!r} names no directory; give a directory name{default}", field="--out-dir")
            return fn(*args, **params)
        return option(checked)
    return decorate


def plot_option(help: str):
    """``--plot FILE.png`` (as ``plot_path``): a picture of the result (the ``plot`` extra)."""
    option = click.option("--plot", "plot_path", metavar="FILE.png", type=click.Path(dir_okay=False), default=None,
                          help=help + " (needs the plot extra: matplotlib)")
    return not_an_input("plot_path", "--plot", option)


def json_option(f=None, *, help: str = "Machine-readable output on stdout."):
    """``--json`` (as ``as_json``): ``@json_option`` or ``@json_option(help="what is printed")``."""
    option = click.option("--json", "as_json", is_flag=True, help=help)
    return option(f) if f is not None else option


class UserError(click.ClickException):
    """A PiperError on its way out of the CLI: printed as ``error: <one line>``, exit code 2."""

    exit_code = EXIT_USER_ERROR

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def _command_line_int(value) -> int:
    """An int default as it is; a typed value through fileio.ascii_int, up to 100 digits (a larger value than
    an option takes meets its range check, or the spec's, which says what is allowed), else ValueError."""
    from piper_plan.fileio import ascii_int

    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return ascii_int(str(value), max_digits=100)


class AsciiInt(click.IntRange):
    """click's IntRange (no bounds: any integer) read with ASCII digits only: click's own ``int()`` also takes
    '1_0' (ten), '١٦' and '１６', which `plan --nodes`, the YAML and the CSV readers refuse."""

    name = "integer"
    _number_class = staticmethod(_command_line_int)

    def _describe_range(self) -> str:
        """The range --help shows: none without bounds (click's own wrote 'x<=None'; the spec says what is allowed)."""
        return "" if self.min is None and self.max is None else super()._describe_range()


class OneLineUsageError(click.UsageError):
    """A click usage error (bad option value, unknown option, missing argument) printed on one line."""

    exit_code = EXIT_USER_ERROR

    def show(self, file=None) -> None:
        path = self.ctx.command_path if self.ctx else "piper"
        message = " ".join(self.format_message().split())
        click.echo(f"error: {path}: {message} (see '{path} --help')", err=True)

    @classmethod
    def of(cls, exc: click.UsageError) -> "OneLineUsageError":
        return cls(exc.format_message(), exc.ctx)


def fail(message: str) -> None:
    """Raise a user error from inside a command."""
    raise PiperError(message)


def platform_calibration(platform_name: str):
    """calibration/<platform>/ as a Calibration, or None when the folder holds no CSVs (then the cost model uses
    the platform's roofline fallback and says so). The folder is looked at first so that a platform without CSVs
    does not pay for importing pandas and scipy."""
    from piper_plan.catalog import has_calibration

    if not has_calibration(platform_name):
        return None
    from piper_plan.calibration import load_calibration

    return load_calibration(platform_name)
