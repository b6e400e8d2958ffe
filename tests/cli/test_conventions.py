"""What every command shares (docs/design-notes.md, "The command line"): --json, exit codes in --help."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from piper_plan.cli.main import COMMANDS, cli


def leaf_commands() -> list[tuple[str, click.Command]]:
    """(path, command) of every command a user runs, groups that run something themselves included."""
    ctx = click.Context(cli)
    found = []

    def walk(path: str, command: click.Command) -> None:
        if isinstance(command, click.Group):
            if command.invoke_without_command:
                found.append((path, command))
            for name in command.list_commands(ctx):
                walk(f"{path} {name}", command.get_command(ctx, name))
        else:
            found.append((path, command))

    for name in COMMANDS:
        walk(name, cli.get_command(ctx, name))
    return found


COMMAND_PATHS = [path for path, _ in leaf_commands()]


def test_the_walk_finds_every_command():
    assert {"calibrate", "calibrate overhead", "calibrate slurm", "run", "launch", "plan", "bench a2a"} <= set(COMMAND_PATHS)
    assert len(COMMAND_PATHS) >= 20


@pytest.mark.parametrize("path", COMMAND_PATHS)
def test_every_command_takes_json_and_documents_its_exit_codes(path):
    command = dict(leaf_commands())[path]
    assert "--json" in {opt for p in command.params for opt in p.opts}, path
    shown = CliRunner().invoke(cli, [*path.split(), "--help"])
    text = " ".join(shown.stdout.split())           # click wraps the epilog
    assert shown.exit_code == 0 and "Exit codes: 0 ok" in text and "2 bad input" in text, path


def test_group_help_lists_every_exit_code():
    text = " ".join(CliRunner().invoke(cli, ["--help"]).stdout.split())
    for code in ("0 ok", "1 a check failed", "2 bad input", "3 nothing fits", "75 run checkpointed"):
        assert code in text
