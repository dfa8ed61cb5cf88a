"""One CLI convention, checked by walking the command table: ``--version``; ``--json PATH``
everywhere with ``-`` for standard output; ``--cluster`` and ``$KVSTORE_CLUSTER`` on every
command that talks to a cluster; no traceback for a missing file, a bad flag or a bad unit;
help that imports no heavy module; a heartbeat off a terminal."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.cli import progress
from kvstore.cli.args import CLUSTER_ENV, STDOUT_PATH, is_stdout, write_json
from kvstore.cli.commands import COMMANDS, build_parser, main, package_version

# Commands whose results people keep or pipe: each takes --json PATH.
WITH_JSON = {
    ("cluster", "status"), ("purge",), ("get",), ("put",), ("del",), ("ttl",), ("inspect",),
    ("sim",), ("sim", "replay"), ("plan",), ("demo",),
    *(cmd for cmd in COMMANDS if cmd[0] == "bench"),
}  # fmt: skip
# Commands that talk to a running cluster through its map: each takes --cluster (or the env).
WITH_CLUSTER = {
    ("cluster", "status"), ("purge",), ("get",), ("put",), ("del",), ("ttl",), ("inspect",),
    ("sim", "replay"), ("bench", "storage"), ("bench", "swapin"), ("bench", "engine"),
    ("bench", "serve"), ("serve",), ("demo",),
}  # fmt: skip
# Flags whose value is a file or directory the command reads (the missing-file case), the
# command's main input first.
INPUT_FLAGS = ("--sim", "--trace", "--config", "--cluster", "--dir")
CREATES_ITS_DIR = {("cluster", "up"), ("certs", "init")}
# What a command needs besides its required arguments to reach its input file.
EXTRA_ARGS = {("put",): ["a value"]}
# Commands that still run long before they read a missing input (other areas' modules).
READS_INPUT_LATE = {
    ("demo",): "engine_adapter/serving/demo.py starts its workers before it reads --cluster",
}
# Modules that take seconds to import; printing help must not need them.
HEAVY_MODULES = ("torch", "ucxx", "ray", "matplotlib", "fastapi", "uvicorn", "transformers")
# Help still imports torch here, in the engine's modules: strict, so the entry must go
# once the module imports torch lazily.
HEAVY_HELP = {
    ("bench", "engine"): "bench/engine_bench.py imports the engine",
    ("bench", "swapin"): "bench/swapin_bench.py imports the engine's host buffers",
}
COMMAND_IDS = " ".join
UNITS = ("size", "duration", "count")  # the names of the unit-parsing argparse types (args.py)
OUTPUT_FLAGS = ("--json", "--out", "--parquet", "--plot", "--plot-dir", "--run-dir")


def _dummy(action: argparse.Action) -> str:
    """A value argparse accepts for a required argument (the case under test is elsewhere)."""
    if action.choices:
        return str(next(iter(action.choices)))
    return "1" if action.type is int else "x"


def _required_args(parser: argparse.ArgumentParser, skip: str | list[str] = "") -> list[str]:
    """Values for the required arguments of ``parser`` but the ``skip`` flags."""
    skipped = {skip} if isinstance(skip, str) else set(skip)
    argv: list[str] = []
    for action in parser._actions:
        if skipped & set(action.option_strings):
            continue
        if not action.option_strings and action.nargs not in (0, "?", "*"):
            argv.append(_dummy(action))
        elif action.required:
            argv += [action.option_strings[0], _dummy(action)]
    for group in parser._mutually_exclusive_groups:
        if group.required and not any(
            skipped & set(a.option_strings) for a in group._group_actions
        ):
            first = group._group_actions[0]
            argv += [first.option_strings[0], _dummy(first)]
    return argv


def _exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvstore {package_version()}"
    assert package_version()[0].isdigit(), "the installed package has a version"


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=COMMAND_IDS)
def test_a_bad_flag_is_a_usage_error(command: tuple[str, ...], capsys) -> None:
    parser, _ = build_parser(command)
    argv = [*command, *_required_args(parser), "--no-such-flag"]
    assert _exit_status(argv) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=COMMAND_IDS)
def test_a_bad_unit_is_a_usage_error(command: tuple[str, ...], capsys) -> None:
    parser, _ = build_parser(command)
    unit_flags = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and any(u in getattr(a.type, "__name__", "") for u in UNITS)
    ]
    if not unit_flags:
        pytest.skip(f"kvstore {' '.join(command)} takes no size, duration or count")
    for flag in unit_flags:
        argv = [*command, *_required_args(parser, skip=flag), flag, "12parsecs"]
        assert _exit_status(argv) == 2, f"{flag} 12parsecs was accepted"
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and "12parsecs" in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=COMMAND_IDS)
def test_a_missing_file_is_a_one_line_error(
    command: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if command in READS_INPUT_LATE:
        pytest.skip(READS_INPUT_LATE[command])
    parser, _ = build_parser(command)
    options = {s for a in parser._actions for s in a.option_strings}
    required = {s for a in parser._actions if a.required for s in a.option_strings}
    inputs = [f for f in INPUT_FLAGS if f in options]
    if not inputs or command in CREATES_ITS_DIR:
        pytest.skip(f"kvstore {' '.join(command)} reads no file or directory it is given")
    # The main input, and every other input the command requires, all missing.
    flags = [inputs[0], *(f for f in inputs[1:] if f in required)]
    argv = [*command, *_required_args(parser, skip=flags)]
    for flag in flags:
        argv += [flag, str(tmp_path / "nowhere" / flag.strip("-"))]
    status = _exit_status([*argv, *EXTRA_ARGS.get(command, [])])
    captured = capsys.readouterr()
    assert status != 0, f"a missing {flags} was taken for success:\n{captured.out}"
    assert "Traceback" not in captured.err
    assert "nowhere" in captured.err, f"the error does not name the missing path: {captured.err}"


@pytest.mark.parametrize("command", sorted(WITH_JSON), ids=COMMAND_IDS)
def test_json_takes_a_path_or_dash(command: tuple[str, ...], tmp_path: Path) -> None:
    parser, _ = build_parser(command)
    base = _required_args(parser, skip="--json")
    assert parser.parse_args([*base, "--json", str(tmp_path / "r.json")]).json == (
        tmp_path / "r.json"
    )
    assert is_stdout(parser.parse_args([*base, "--json", "-"]).json), "--json - is stdout"


def test_json_alone_stays_stdout_where_it_was_a_switch() -> None:
    for command in (("cluster", "status"), ("purge",)):
        parser, _ = build_parser(command)
        args = parser.parse_args([*_required_args(parser, skip="--json"), "--json"])
        assert is_stdout(args.json), f"kvstore {' '.join(command)} --json broke old scripts"


@pytest.mark.parametrize("command", sorted(WITH_CLUSTER), ids=COMMAND_IDS)
def test_cluster_comes_from_the_environment(
    command: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cluster.toml").write_text("")
    monkeypatch.setenv(CLUSTER_ENV, str(tmp_path))  # a directory holding cluster.toml
    parser, _ = build_parser(command)
    args = parser.parse_args(_required_args(parser, skip="--cluster"))
    assert args.cluster == tmp_path / "cluster.toml", f"{CLUSTER_ENV} was not used"
    monkeypatch.delenv(CLUSTER_ENV)
    parser, _ = build_parser(command)
    given = parser.parse_args([*_required_args(parser, skip="--cluster"), "--cluster", "c.toml"])
    assert given.cluster == Path("c.toml")


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=HEAVY_HELP[c]))
        if c in HEAVY_HELP
        else c
        for c in sorted(COMMANDS)
    ],
    ids=COMMAND_IDS,
)
def test_help_imports_no_heavy_module(command: tuple[str, ...]) -> None:
    probe = (
        "import contextlib, io, json, sys\n"
        "from kvstore.cli.commands import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({[*command, '--help']!r})\n"
        f"print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert imported == [], f"kvstore {' '.join(command)} --help imports {imported}: import lazily"


def test_json_dash_writes_to_standard_output_itself(tmp_path: Path) -> None:
    """``--json -`` output goes to file descriptor 1 as it is: appended, never truncated."""
    out = tmp_path / "out.txt"
    out.write_text("before\n")
    probe = (
        "from kvstore.cli.args import STDOUT_PATH, write_json\nwrite_json({'a': 1}, STDOUT_PATH)\n"
    )
    with out.open("a") as appended:
        subprocess.run([sys.executable, "-c", probe], stdout=appended, check=True, timeout=120)
    before, document = out.read_text().split("\n", 1)
    assert before == "before" and json.loads(document) == {"a": 1}
    write_json({"b": 2}, tmp_path / "deeper" / "r.json")
    assert json.loads((tmp_path / "deeper" / "r.json").read_text()) == {"b": 2}
    assert STDOUT_PATH.parent.exists()


def test_heartbeat_speaks_when_the_command_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()  # not a terminal
    with progress.Heartbeat("bench repair", stream=stream, interval_s=0.05):
        deadline_s = time.monotonic() + 60
        while "running" not in stream.getvalue() and time.monotonic() < deadline_s:
            time.sleep(0.01)
    assert "[kvstore] bench repair: running, " in stream.getvalue()
    # A command that prints its own progress keeps the heartbeat quiet.
    quiet = io.StringIO()
    with (
        progress.Heartbeat("sim", stream=quiet, interval_s=3600.0),
        progress.ProgressReporter("sim", 2, stream=quiet, interval_s=0.0) as reporter,
    ):
        reporter.advance()
    assert "running" not in quiet.getvalue() and "sim: done" in quiet.getvalue()


def test_nothing_the_readme_runs_overwrites_a_tracked_file() -> None:
    root = Path(__file__).resolve().parents[3]
    listed = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, timeout=60, check=True
    )
    tracked = set(listed.stdout.split())
    written = []
    for command in re.findall(r"`(kvstore [^`]*)`", (root / "README.md").read_text()):
        words = command.split()
        written += [value for flag, value in itertools.pairwise(words) if flag in OUTPUT_FLAGS]
    assert written, "the README runs no command that writes a file: the scan is broken"
    clobbered = [
        path
        for path in written
        if path in tracked or any(t.startswith(path.rstrip("/") + "/") for t in tracked)
    ]
    assert not clobbered, f"README commands overwrite tracked files: {clobbered}; use out/"
