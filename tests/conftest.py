"""Fixtures that tests of several packages share, and the session's check that no process a
test started outlives it (tests/leftover_processes.py)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

import pytest

from erasure import fastsum
from tests import leftover_processes

# Set at import, before any test starts a process: every child inherits it (the runner of
# `make test` set an outer marker; this session nests its own under it).
SESSION_MARKER = leftover_processes.new_marker(os.environ.get(leftover_processes.MARKER))
os.environ[leftover_processes.MARKER] = SESSION_MARKER

# pid -> the module after which it was first seen alive (the session-end report names it).
_pid_to_first_seen: dict[int, str] = {}
_leftover_reports: list[str] = []  # the session-end sweep's, for the terminal summary


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    """A SIGTERM (a CI job cancelled, the runner passing one on) stops the session as Ctrl-C
    does: fixtures tear down and the session-end sweep runs. Later ones are ignored, so one
    sent to the process group and passed on by the runner too cannot cut the teardown short
    (SIGKILL still ends it; the runner then sweeps)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last test (its module fixtures torn down), note the marked processes
    alive then: a leftover at the session's end is reported with the module that started it.
    Not a failure here: session-scoped fixtures keep processes across modules."""
    yield
    if nextitem is not None and nextitem.path == item.path:
        return
    for leftover in leftover_processes.find(SESSION_MARKER):
        _pid_to_first_seen.setdefault(leftover.pid, item.nodeid.split("::")[0])


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of what fixtures are still set up
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Kill every process of this session still alive, and fail the session naming them.

    Under pytest-xdist every worker is a session of its own, nested under the controller's
    marker (it sets its own at import), and sweeps what its tests left. The workers carry the
    controller's marker too (inherited): the controller's sweep, after theirs, spares them
    while they exit and catches what a worker that died left. A worker hands its report to
    the controller (xdist's workeroutput), which fails the run and prints it."""
    workers = _xdist_workers(session.config)
    leftovers = leftover_processes.sweep(SESSION_MARKER, exclude=workers)
    if not leftovers:
        if _leftover_reports and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a worker's, reported to us
        return
    first_seen = {pid: f"alive after {module}" for pid, module in _pid_to_first_seen.items()}
    text = leftover_processes.report(leftovers, "the test session", first_seen)
    _leftover_reports.append(text)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["leftover_processes"] = text
    if session.config.pluginmanager.get_plugin("terminalreporter") is None:
        print(text, file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _xdist_workers(config: pytest.Config) -> set[int]:
    """The xdist worker processes (this process's children) when this is the controller."""
    if not config.pluginmanager.hasplugin("dsession"):
        return set()
    me = os.getpid()
    return {
        pid for pid in leftover_processes.live_pids() if leftover_processes.parent_pid(pid) == me
    }


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """On the xdist controller: a worker's leftover report (see pytest_sessionfinish)."""
    text = getattr(node, "workeroutput", {}).get("leftover_processes")
    if text:
        gateway = getattr(node, "gateway", None)
        _leftover_reports.append(f"{gateway.id if gateway else 'a worker'}: {text}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for text in _leftover_reports:
        terminalreporter.write_sep("=", "processes left behind", red=True)
        terminalreporter.write_line(text)


@pytest.fixture(params=["native", "python"])
def checksum_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs with the native checksum helper (where `make native` built it) and with
    its python-xxhash fallback (erasure/fastsum.py)."""
    if request.param == "native":
        if not fastsum.NATIVE:
            pytest.skip("erasure/_fastsum.so is not built (make native)")
    else:
        monkeypatch.setattr(fastsum, "_lib", None)
        monkeypatch.setattr(fastsum, "NATIVE", False)
    return request.param
