"""Ports for local nodes: a port free_ports hands out stays this process's until released, so
another process (another test worker, another bench) never draws it while a node of ours is
down and about to come back on it."""

from __future__ import annotations

import subprocess
import sys

from deploy import local_nodes
from deploy.local_nodes import free_ports, release_ports
from tests.kvstore.node_harness import REPO_ROOT

HOLDER = (
    "from deploy.local_nodes import free_ports\n"
    "print(*free_ports(4), flush=True)\n"
    "input()\n"  # holds them until the test closes stdin
)


def test_a_port_another_process_holds_is_never_handed_out_and_comes_back_when_it_exits():
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        held = [int(port) for port in holder.stdout.readline().split()]
        assert len(set(held)) == 4
        # Nothing listens on them: only the reservation keeps them from this process.
        assert not any(local_nodes._reserve(port) for port in held)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    # The holder exited without releasing: the kernel dropped its locks.
    assert all(local_nodes._reserve(port) for port in held)
    release_ports(held)


def test_released_ports_are_free_for_the_next_caller_and_held_ones_are_distinct():
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert not any(local_nodes._reserve(port) for port in ports), "held twice by one process"
    release_ports(ports)
    assert all(local_nodes._reserve(port) for port in ports)
    release_ports(ports)
