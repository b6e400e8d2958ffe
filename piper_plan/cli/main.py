"""The ``piper`` command: a click group whose subcommands are imported only when used.

Each command lives in its own module (one file per command, as in hatch); this file only maps
names to modules so that ``piper --help`` stays fast and the planner never imports torch.
"""

from __future__ import annotations

import importlib

import click

from piper_plan import __version__

# name -> (module, attribute, one-line help shown by `piper --help` without importing the module)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "models": ("piper_plan.cli.models", "models_cmd", "List the model catalog."),
    "model": ("piper_plan.cli.models", "model_group", "Show or import one model spec."),
    "platforms": ("piper_plan.cli.platforms", "platforms_cmd", "List the platform catalog."),
    "platform": ("piper_plan.cli.platforms", "platform_group", "Show one platform spec."),
    "estimate": ("piper_plan.cli.estimate", "estimate_cmd", "Predict memory and step time of one parallel plan."),
    "plan": ("piper_plan.cli.plan", "plan_cmd", "Search and rank every valid parallel configuration."),
    "calibrate": ("piper_plan.cli.calibrate", "calibrate_group", "Measure a machine (GEMM, attention, collectives)."),
    "bench": ("piper_plan.cli.bench", "bench_group", "Communication benchmarks (flat vs HALO all-to-all)."),
    "migrate": ("piper_plan.cli.migrate", "migrate_group", "Expert migration: simulate the swap planner."),
    "run": ("piper_plan.cli.run", "run_cmd", "Run the training runtime on a plan.json (alias of python -m piper_plan.runtime.train)."),
    "export": ("piper_plan.cli.export", "export_cmd", "Write a plan's launch for torchtitan or Megatron-LM."),
    "launch": ("piper_plan.cli.launch", "launch_cmd", "Write (and submit) a Slurm job for a plan."),
    "status": ("piper_plan.cli.status", "status_cmd", "Show a Slurm job and its run directory."),
    "compare": ("piper_plan.cli.compare", "compare_cmd", "Measured (metrics.jsonl) vs predicted (plan.json)."),
    "validate": ("piper_plan.cli.validate", "validate_cmd", "Predict published measurements and report the error."),
    "reproduce": ("piper_plan.cli.reproduce", "reproduce_group", "Regenerate the paper's tables and figures."),
}


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when that subcommand runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name, (module, _, _) in COMMANDS.items() if _module_exists(module))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        if not _module_exists(module):
            return None
        return getattr(importlib.import_module(module), attr)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context):
        from piper_plan.cli.common import UserError, stdout_closed
        from piper_plan.errors import PiperError

        try:
            return super().invoke(ctx)
        except BrokenPipeError:            # click's own handler exits 1, which piper keeps for a failed check
            stdout_closed()
        except PiperError as exc:
            raise UserError(str(exc)) from None
        except KeyboardInterrupt:          # click's own handler says "Aborted!" and exits 1 (a failed check here)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except OSError as exc:             # what the system refuses (a name over 255 bytes, stdout on a full disk)
            raise UserError(os_error_line(exc)) from None
        except click.UsageError as exc:
            raise _one_line(exc) from None
        except ModuleNotFoundError as exc:
            missing = _missing_extra(exc)
            if missing is None:
                raise
            raise missing from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT): 128 + 2, as a shell reports a program the signal stopped."""


def os_error_line(exc: OSError) -> str:
    """An OSError as one line: the path it names (cut to 120 characters) and the system's reason."""
    name = exc.filename
    if name is None:
        return f"the system refused a read or write: {exc.strerror or exc}"
    shown = str(name) if len(str(name)) <= 120 else str(name)[:117] + "..."
    return f"{shown}: {exc.strerror or exc}"


def _one_line(exc: click.UsageError) -> click.UsageError:
    """Click's usage errors (three lines: usage, hint, message) as one ``error:`` line; help stays help."""
    from piper_plan.cli.common import OneLineUsageError

    if isinstance(exc, (click.exceptions.NoArgsIsHelpError, OneLineUsageError)):
        return exc
    return OneLineUsageError.of(exc)


EXTRAS = {"torch": "runtime", "matplotlib": "plot", "torchtitan": "export"}
"""Optional packages -> the pyproject extra that installs them (the planner itself needs none)."""


def _missing_extra(exc: ModuleNotFoundError):
    """A command that needs an optional package not installed: one line naming it and the extra that installs it.
    None where the package is installed (a module missing inside it: a torch built without distributed, a version
    mismatch) or no extra brings it: a broken installation, whose traceback is kept."""
    from piper_plan.cli.common import UserError

    package = (exc.name or "").split(".")[0]
    if package not in EXTRAS or _module_exists(package):
        return None
    return UserError(f"this command needs {package}, which is not installed: pip install -e "
                     f"'.[{EXTRAS[package]}]' in piper's checkout (its extra {EXTRAS[package]}; scripts/install.sh "
                     "--test installs every extra)")


def _module_exists(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None


EPILOG = ("Output: a command's result (table, report) on stdout; progress and diagnostics (\"wrote X\") on stderr; "
          "--json (every command) replaces the result on stdout with one JSON document. "
          "Exit codes: 0 ok; 1 a check failed (validate: a row outside its tolerance; bench a2a --verify; run: the loss "
          "went nan / inf, or a rank's peer is gone); "
          "2 bad input or a path or output the system refuses (one 'error:' line on stderr); 3 nothing fits "
          "(plan); 75 run checkpointed on SIGTERM / SIGUSR1 / SIGINT (requeue); 130 interrupted (Ctrl-C, other "
          "commands); 141 stdout closed "
          "early (| head); 128 + N run: a rank was killed by signal N.")


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.version_option(__version__, prog_name="piper")
def cli() -> None:
    """piper: plan, calibrate and launch Mixture-of-Experts training on HPC machines."""


def main() -> None:
    """Console-script entry point."""
    escape_what_the_streams_cannot_encode()
    cli(prog_name="piper")


def escape_what_the_streams_cannot_encode() -> None:
    """stdout and stderr write a character their encoding lacks as a backslash escape ('qw\\xe9n'), never a
    UnicodeEncodeError: a model named 'qwén' shown to an ASCII stdout (PYTHONIOENCODING=ascii, LC_ALL=C with
    PYTHONUTF8=0) ended `piper model show` in a traceback, exit 1."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):         # None where closed (`piper models >&-`)
            stream.reconfigure(errors="backslashreplace")


if __name__ == "__main__":          # python -m piper_plan.cli.main: the calibration job's compute step (no venv bin/)
    main()
