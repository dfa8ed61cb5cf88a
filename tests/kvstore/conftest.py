"""Fixtures of the node tests: start real node processes and stop them, also on failure."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.kvstore.node_harness import NodeProcess


@pytest.fixture
def start_node() -> Iterator[Callable[..., NodeProcess]]:
    """``start_node(config_path, extra_args=())`` -> a ready node, stopped at teardown."""
    started: list[NodeProcess] = []

    def start(config_path: Path, extra_args: tuple[str, ...] = ()) -> NodeProcess:
        node = NodeProcess(config_path, extra_args=extra_args)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.stop()
