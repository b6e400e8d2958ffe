"""Validation and shell quoting of every value that reaches an sbatch script.

Two kinds of places take values in a job script:

- ``#SBATCH`` lines are parsed by sbatch itself, not by a shell (src/sbatch/opt.c ``_get_argument``): it splits a
  line at whitespace outside quotes, takes ``"..."`` and ``'...'`` as quotes and a backslash as an escape, ends the line
  at an unescaped ``#``, and reads a line holding ``hetjob`` or ``packjob`` anywhere as a heterogeneous-job separator.
  Names and options there are plain tokens (allow-lists below); a path (the job directory, in ``--chdir`` and
  ``--output``) is checked by ``sbatch_path`` and written by ``sbatch_word``, double-quoted where it needs quoting.
- the script body is bash: every value is passed through ``shlex.quote`` (names and options are validated tokens
  too; a path there may be any absolute path without NUL or newline, ``body_path``); environment values may
  reference other variables (``$USER``, ``${SLURM_JOB_ID}``) and nothing else.

Every failure is a PiperError naming the field, the value (repr, so a newline shows) and what is allowed.
"""

from __future__ import annotations

import re
import shlex
import unicodedata

from piper_plan.errors import PiperError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""Job names, partitions, accounts: letters, digits, '.', '_', '-' (first a letter or digit)."""
SBATCH_PATH_ALLOWED = ("an absolute path without '%', a double quote, '#', a backslash, control characters or the "
                       "words hetjob / packjob (letters of any script, spaces, single quotes and other punctuation "
                       "are fine)")
SBATCH_PLAIN_RE = re.compile(r"[^\s\"'#\\]*")
"""An #SBATCH argument sbatch reads as it is: no whitespace, quote, '#' or backslash (sbatch_word quotes others)."""
BODY_PATH_ALLOWED = "an absolute path without NUL or newline"
HET_JOB_RE = re.compile(r"hetjob|packjob", re.IGNORECASE)
TIME_RE = re.compile(r"(?:([0-9]{1,3})-)?([0-9]{1,4}):([0-5][0-9]):([0-5][0-9])")
"""Slurm wall time [D-]HH:MM:SS (ASCII digits: ``\\d`` would take '٠٢')."""
MAX_WALL_S = 365 * 86400
"""Longest wall time piper writes into a job: 365 days (Slurm's own INFINITE aside, no site allows more)."""
MODULE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+-]*")
"""Lmod module names, optionally with /version."""
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_VALUE_RE = re.compile(r"(?:[A-Za-z0-9_./:,=@+%-]|\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\})*")
"""Plain characters plus ``$NAME`` / ``${NAME}`` references; no command substitution, quotes or spaces."""
OPTION_RE = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(?:=[A-Za-z0-9._:/@,+=-]+)?")
"""One sbatch/srun option token: ``--gpu-bind=closest``, ``-C nvme`` is two tokens and not allowed."""
OWN_SBATCH_OPTIONS = frozenset({
    "chdir", "D", "cpus-per-task", "c", "gpus-per-task", "job-name", "J", "nodes", "N", "ntasks-per-node", "ntasks",
    "n", "open-mode", "output", "o", "error", "e", "requeue", "no-requeue", "signal", "time", "t", "partition", "p",
    "account", "A", "switches", "segment"})
"""sbatch options the job script sets itself (platforms/templates/*.sbatch), writes from settings of its own
(--partition, --account, --time; --switches and --segment from the platform's topology: launch/render.py), or that
would contradict them (--error splits the job's output file, --ntasks its rank count): a platform's extra
``launch.sbatch`` line after them would override them. Short forms with an attached value (``-t5``) and long
prefixes sbatch expands (``--outp=x``) count as the option."""
SHELL_CONTROL_ENV = frozenset({"IFS", "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "BASH_COMPAT", "CDPATH",
                               "GLOBIGNORE", "EXECIGNORE", "PS4", "BASH_XTRACEFD", "POSIXLY_CORRECT",
                               "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_RESTART_COUNT"})
"""Variables that change how bash reads and runs the rest of the job script (bash(1), "Shell Variables"), and the
Slurm variables the script reads after the platform's exports (its rendezvous address and port, --resume on a
requeue): a platform's ``launch.env`` may not export them. PATH and LD_LIBRARY_PATH stay allowed (module
environments set them)."""


def _check(value: object, pattern: re.Pattern, field: str, allowed: str) -> str:
    text = str(value)
    if not pattern.fullmatch(text):
        raise PiperError(f"{field}={text!r} is not allowed; allowed: {allowed}", field=field)
    return text


def job_name(value: str) -> str:
    return _check(value, NAME_RE, "job_name", "1-128 of letters, digits, '.', '_', '-' (no spaces or shell characters)")


def default_job_name(model_name: str, nodes: int) -> str:
    """The job name piper picks when none is given: ``piper-<model>-<nodes>n``, each run of characters a job name
    may not hold (a model's name may be any printable line) as one '-', cut to NAME_RE's 128 characters."""
    return f"piper-{name_token(model_name, 'model')}"[:128 - len(f"-{nodes}n")] + f"-{nodes}n"


def name_token(name: str, fallback: str) -> str:
    """``name`` (a model's or platform's: any printable line) as a job-name and file-name token: each run of
    characters NAME_RE does not allow as one '-' (sbatch splits an unquoted option at a space; '%' is a pattern)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or fallback


def slurm_name(value: str, field: str) -> str:
    """A partition or account name."""
    return _check(value, NAME_RE, field, "letters, digits, '.', '_', '-' (no spaces or shell characters)")


def _named(text: str, field: str | None, source: str | None) -> str:
    """How an error names a value: ``--out-dir='/x'``, or the value and where it came from (one the user never
    gave, e.g. a default)."""
    return f"{field}={text!r}" if source is None else f"{text!r} ({source})"


def body_path(value: object, field: str, source: str | None = None) -> str:
    """A path written only into the script's bash body (shell-quoted there): absolute, without NUL or newline (bash
    cannot hold a NUL; a newline would end the comment lines that name it) and encodable as UTF-8."""
    text = str(value)
    _refuse(text, field, source, _body_path_problem(text), BODY_PATH_ALLOWED)
    return text


def sbatch_path(value: object, field: str, source: str | None = None) -> str:
    """A path sbatch reads from an ``#SBATCH`` line (the job directory: ``--chdir``, ``--output``): what sbatch
    cannot read back as written is refused, each with its reason; anything else is written by ``sbatch_word``."""
    text = str(value)
    _refuse(text, field, source, _body_path_problem(text) or _sbatch_path_problem(text), SBATCH_PATH_ALLOWED)
    return text


def _refuse(text: str, field: str, source: str | None, why: str | None, allowed: str) -> None:
    """One PiperError line when ``why`` (naming the value by ``_named``), else nothing."""
    if why:
        raise PiperError(f"{_named(text, field, source)} is not allowed: {why}; allowed: {allowed}",
                         field=None if source else field)


def _body_path_problem(text: str) -> str | None:
    if not text.startswith("/"):
        return "it is not an absolute path"
    if "\0" in text or "\n" in text:
        return "it holds a NUL or a newline"
    return "it is not valid UTF-8 (the script is written as UTF-8)" if _surrogates(text) else None


def _sbatch_path_problem(text: str) -> str | None:
    """Why sbatch would not read ``text`` back from an #SBATCH line as written, or None."""
    het = HET_JOB_RE.search(text)
    control = next((c for c in text if unicodedata.category(c) == "Cc"), None)
    problems = (("%" in text, "sbatch reads '%' as a file-name pattern (--output's %j)"),
                ("\\" in text, "a backslash is sbatch's escape and turns off --output's file-name patterns"),
                ('"' in text or "#" in text, "a double quote or '#' needs a backslash escape there, which turns off "
                                             "--output's file-name patterns (its %j)"),
                (het, f"sbatch reads a line holding {het and het.group(0)!r} as the start of another "
                      "heterogeneous-job component"),
                (control, f"the control character {control!r} cannot be written"))
    why = next((why for found, why in problems if found), None)
    return why and f"it goes into the script's #SBATCH lines, where {why}"


def _surrogates(text: str) -> bool:
    return any(unicodedata.category(c) == "Cs" for c in text)


def sbatch_word(text: str) -> str:
    """``text`` as one argument of an #SBATCH line: as it is where sbatch reads it so, else in double quotes (sbatch's
    own quoting, src/sbatch/opt.c). ``text`` must have passed ``sbatch_path``: no backslash, double quote, '#',
    newline or NUL, so nothing inside the quotes needs an escape (a backslash would turn off --output's %j)."""
    if SBATCH_PLAIN_RE.fullmatch(text):
        return text
    return f'"{text}"'


def wall_time(value: str) -> str:
    """Slurm [D-]HH:MM:SS, more than zero and at most MAX_WALL_S (hours below 24 after a day count); returned
    unchanged."""
    allowed = "[D-]HH:MM:SS, e.g. 02:00:00, above 00:00:00 and at most 365 days (HH < 24 after D-)"
    _check(value, TIME_RE, "--time", allowed)                      # a value of --time (launch, calibrate slurm)
    days, hours, minutes, seconds = (int(g or 0) for g in TIME_RE.fullmatch(str(value)).groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total == 0 or total > MAX_WALL_S or (TIME_RE.fullmatch(str(value)).group(1) is not None and hours > 23):
        raise PiperError(f"--time={str(value)!r} is not allowed; allowed: {allowed}", field="--time")
    return str(value)


def format_wall_time(seconds: float) -> str:
    """Seconds -> HH:MM:SS (hours may exceed 24; Slurm accepts that); at most MAX_WALL_S."""
    if not 0 < seconds <= MAX_WALL_S:
        raise PiperError(f"a wall time of {seconds:.3g} s is not allowed; allowed: above 0 and at most 365 days "
                         "(fewer --steps, or give --time)", field="time")
    total = int(round(seconds))
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"


def module_name(value: str) -> str:
    return _check(value, MODULE_RE, "launch.modules", "module names of letters, digits and . _ / + -")


def env_pair(key: str, value: str) -> tuple[str, str]:
    _check(key, ENV_KEY_RE, "launch.env", "variable names [A-Za-z_][A-Za-z0-9_]*")
    if key in SHELL_CONTROL_ENV:
        raise PiperError(f"launch.env={key!r} is not allowed: it changes how bash runs the job script; allowed: any "
                         f"other variable name (not {', '.join(sorted(SHELL_CONTROL_ENV))})", field="launch.env")
    _check(value, ENV_VALUE_RE, f"launch.env.{key}", "letters, digits, . _ / : , = @ + % - and $NAME / ${NAME}")
    return key, str(value)


def option_token(value: str, field: str) -> str:
    return _check(value, OPTION_RE, field, "one option token like --gpu-bind=closest (no spaces or shell characters)")


def sbatch_option(value: str) -> str:
    """A platform's extra #SBATCH option: one token, and none the job script sets itself (OWN_SBATCH_OPTIONS)."""
    token = option_token(value, "launch.sbatch")
    long_form = token.startswith("--")
    name = token[2:].split("=")[0] if long_form else token[1]      # '-t5': sbatch reads option t, value 5
    own = ([o for o in OWN_SBATCH_OPTIONS if len(o) > 1 and o.startswith(name)] if long_form
           else [name] if name in OWN_SBATCH_OPTIONS else [])
    if own:
        shown = ("--" if len(own[0]) > 1 else "-") + (name if name in own else own[0])
        raise PiperError(f"launch.sbatch={token!r} is not allowed: the job script sets {shown} itself or from a "
                         "setting of piper's (--partition, --account, --time, the platform's topology); allowed: "
                         "another sbatch option", field="launch.sbatch")
    return token


def launch_block(launch) -> dict:
    """A platform's ``launch`` block (specs/platform.py LaunchSpec), validated for the job script: modules, env, srun
    and sbatch options, partition (a bad value is one PiperError naming its field, ``launch.env``...)."""
    return {"modules": tuple(module_name(m) for m in launch.modules),
            "env": tuple(env_pair(k, val) for k, val in launch.env.items()),
            "srun_extra": tuple(option_token(o, "launch.srun") for o in launch.srun),
            "sbatch_extra": tuple(sbatch_option(o) for o in launch.sbatch),
            "partition": None if launch.partition is None else slurm_name(launch.partition, "launch.partition")}


def positive_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PiperError(f"{field}={value!r} is not allowed; allowed: a positive integer", field=field)
    return value


def shell_quote(value: object) -> str:
    """A single shell word for bash (``shlex.quote``)."""
    return shlex.quote(str(value))
