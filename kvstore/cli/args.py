"""Argument helpers every command's parser shares: the help formatter that shows defaults, and
argparse types for sizes, durations and lists as people write them (ttl/units.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
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
