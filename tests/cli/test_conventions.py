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
    assert "None]" not in text and "=None" not in text, path      # click's range of an unbounded int: 'x<=None'


def test_group_help_lists_every_exit_code():
    text = " ".join(CliRunner().invoke(cli, ["--help"]).stdout.split())
    for code in ("0 ok", "1 a check failed", "a rank's peer is gone", "2 bad input", "3 nothing fits",
                 "75 run checkpointed", "128 + N run: a rank was killed by signal N"):
        assert code in text


# ---- one flag convention: -o/--output FILE, --out-dir DIR; old spellings parse but are not shown ----------------
OLD_SPELLINGS = {"plan": "--save", "estimate": "--save", "validate": "--markdown", "reproduce halo": "--out",
                 "launch": "--out", "run": "--out", "calibrate": "--out", "calibrate import-nccl-tests": "--out",
                 "calibrate overhead": "--out", "reproduce paper": "--out", "bench a2a": "--output-dir"}


@pytest.mark.parametrize("path", COMMAND_PATHS)
def test_outputs_are_spelled_one_way(path):
    command = dict(leaf_commands())[path]
    shown = " ".join(CliRunner().invoke(cli, [*path.split(), "--help"]).stdout.split())
    for old in ("--save", "--markdown", "--out ", "--output-dir", "--out,"):
        assert old not in shown, (path, old)
    for param in command.params:
        if path in OLD_SPELLINGS and OLD_SPELLINGS[path] in param.opts:
            assert {"--output", "--out-dir"} & set(param.opts), (path, param.opts)


def test_old_spellings_still_work(tmp_path):
    args = ["plan", "--model", "tiny-moe", "--platform", "local-cpu", "--nodes", "1", "--seq", "256",
            "--global-batch", "8"]
    for flag in ("--save", "--output", "-o"):
        path = tmp_path / f"plan{flag}.json"
        done = CliRunner().invoke(cli, [*args, flag, str(path)])
        assert done.exit_code == 0 and path.is_file(), done.output
    missing = CliRunner().invoke(cli, ["launch", "--plan", str(path)])
    assert missing.exit_code == 2 and "'--out-dir'" in missing.stderr and "'--out'" not in missing.stderr


@pytest.mark.parametrize("args", [
    ["calibrate", "import-nccl-tests", "log.txt", "--op", "all_to_all", "--nodes", "1", "--ranks-per-node", "2",
     "--scope", "node"],
    ["calibrate", "show"], ["calibrate", "slurm", "--nodes", "2"], ["calibrate", "overhead"], ["calibrate"],
    ["bench", "a2a"],
])
def test_platform_is_never_picked_for_the_user(args):
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 2 and "--platform" in done.stderr and len(done.stderr.splitlines()) == 1, done.output
