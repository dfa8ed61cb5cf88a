"""Argument helpers every command's parser shares: the help formatter that shows defaults,
argparse types for sizes, durations and lists as people write them (ttl/units.py), and the
conventions of ``--json`` and ``--cluster`` that the command table applies to every command."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ttl.units import parse_duration_s, parse_size_bytes


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help lines that end with the flag's default, unless the line names it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        default = action.default
        if "default" in help_ or not shows_default(action):
            return help_
        return f"{help_} (default: {format_default(default)})"


def shows_default(action: argparse.Action) -> bool:
    """Whether a flag has a default worth showing (not a switch, not "absent")."""
    absent = (
        action.default is None or action.default is False or action.default == argparse.SUPPRESS
    )
    return bool(action.option_strings) and not absent


def format_default(default: Any) -> str:
    """A default as a user would type it: lists comma-separated, 100%% signs escaped."""
    text = ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
    return text.replace("%", "%%")


def arg_type(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse type whose error message is the parser's own (it says the accepted forms)."""

    def parse_arg(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_arg.__name__ = name
    return parse_arg


# Argparse types for sizes and durations as people write them (ttl/units.py): "1GiB", "7d".
size_arg = arg_type(parse_size_bytes, "size")
duration_arg = arg_type(parse_duration_s, "duration")


def list_arg(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type for comma-separated values, each parsed by ``item``."""

    def parse(text: str) -> list[Any]:
        return [item(part.strip()) for part in text.split(",") if part.strip()]

    return arg_type(parse, f"list of {getattr(item, '__name__', 'value')}")


# The conventions every command follows, applied to each command's parser by the command
# table (kvstore/cli/commands.py), whichever module declared the flags:
#   --json PATH      results as JSON at PATH; "-" = standard output (the command's tables then
#                    go to standard error, so `--json - | jq` reads JSON only)
#   --cluster PATH   the cluster's cluster.toml, or a directory holding one; defaults to
#                    $KVSTORE_CLUSTER, so a shell that exported it names no cluster again
STDOUT_NAME = "-"


class _StandardOutput(type(Path())):  # type: ignore[misc]
    """The path ``--json -`` gives: writes go to this process's standard output as it is
    (file descriptor 1, never reopened: reopening /dev/stdout would truncate a file that
    the shell appends standard output to)."""

    def open(self, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode and "+" not in mode:
            raise ValueError("standard output (--json -) can only be written")
        return open(os.dup(1), mode, *args, **kwargs)


STDOUT_PATH = _StandardOutput("/dev/stdout")
CLUSTER_ENV = "KVSTORE_CLUSTER"
CLUSTER_FILE = "cluster.toml"


def json_path(text: str) -> Path:
    """A ``--json`` target: a file path, or standard output for ``-``."""
    return STDOUT_PATH if text == STDOUT_NAME else Path(text)


def is_stdout(path: object) -> bool:
    """Whether a ``--json`` target is standard output (``--json -``)."""
    return path == STDOUT_PATH


def write_json(document: Any, path: Path) -> None:
    """Write a command's ``--json`` result (standard output for ``-``)."""
    if not is_stdout(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def cluster_path(text: str) -> Path:
    """A ``--cluster`` value: the cluster.toml itself, or a directory holding one."""
    path = Path(text)
    return path / CLUSTER_FILE if path.is_dir() else path


def apply_conventions(parser: argparse.ArgumentParser) -> None:
    """Give ``parser``'s ``--json`` and ``--cluster`` flags their common meaning (above)."""
    for action in parser._actions:
        if "--json" in action.option_strings and action.nargs != 0:
            action.type = json_path
            action.metavar = action.metavar or "PATH"
            if action.const == STDOUT_NAME:  # `--json` alone (an old switch): standard output
                action.const = STDOUT_PATH
            action.help = f"{action.help}; - = standard output"
        elif "--cluster" in action.option_strings:
            _cluster_from_env(parser, action)


def _cluster_from_env(parser: argparse.ArgumentParser, action: argparse.Action) -> None:
    action.type = cluster_path
    action.metavar = action.metavar or "PATH"
    action.help = f"{action.help} (a cluster.toml or its directory; default: ${CLUSTER_ENV})"
    from_env = os.environ.get(CLUSTER_ENV)
    if not from_env:
        return
    action.default = cluster_path(from_env)
    action.required = False
    for group in parser._mutually_exclusive_groups:  # `--dir` or `--cluster`: env satisfies it
        if action in group._group_actions:
            group.required = False
