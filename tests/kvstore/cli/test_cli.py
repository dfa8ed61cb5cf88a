"""The ``kvstore`` command tree: every command has its own parser, every flag a help line and
its default, groups list their subcommands, and unknown commands fail clearly."""

from __future__ import annotations

import argparse

import pytest

from kvstore.cli.args import shows_default
from kvstore.cli.commands import COMMANDS, GROUPS, build_parser, main


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_every_flag_has_a_help_line_and_shows_its_default(command: tuple[str, ...]) -> None:
    parser, _ = build_parser(command)
    assert parser.prog == " ".join(("kvstore", *command)), "each command has its own parser"
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"kvstore {' '.join(command)}: {action.option_strings} has no help"
        shown = formatter._get_help_string(action)
        if shows_default(action):
            assert "default" in shown, f"{action.option_strings} hides its default {action.default}"


def test_cluster_subcommands_have_their_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["cluster", "up", "--help"])
    assert exit_info.value.code == 0
    up_help = capsys.readouterr().out
    assert "kvstore cluster up" in up_help and "--nodes" in up_help and "--max-bytes" in up_help
    with pytest.raises(SystemExit):
        main(["cluster", "status", "--help"])
    status_help = capsys.readouterr().out
    assert "--json" in status_help and "--nodes" not in status_help, "status lists up's flags"


@pytest.mark.parametrize("group", sorted(GROUPS), ids=" ".join)
def test_a_group_lists_its_subcommands(group: tuple[str, ...], capsys) -> None:
    assert main([*group, "--help"]) == 0
    out = capsys.readouterr().out
    below = [cmd for cmd in COMMANDS if cmd[: len(group)] == group]
    assert below and all(" ".join(cmd) in out for cmd in below)


def test_top_level_help_and_unknown_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(" ".join(cmd) in out for cmd in COMMANDS), "every command is listed"
    assert main(["cluster", "sideways"]) == 2
    assert "unknown command 'cluster sideways'" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2


def test_sizes_parse_with_units_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    parser, _ = build_parser(("cluster", "up"))
    args = parser.parse_args(["--dir", "x", "--max-bytes", "1GiB"])
    assert args.max_bytes == 1 << 30, "--max-bytes 1GiB must parse like --capacity 2TiB"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dir", "x", "--max-bytes", "lots"])
    assert "bad size 'lots'" in capsys.readouterr().err
