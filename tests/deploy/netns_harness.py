"""Hosts as Linux network namespaces, for the many-host test (tests/deploy/test_netns_hosts.py).

::

    root namespace                         namespace <tag>-h00     namespace <tag>-etcd
    bridge <tag>br 10.215.S.254/24 ──┬── veth <tag>v0 ═ eth0 10.215.S.1
    (the test and its client)        ├── veth <tag>v1 ═ eth0 10.215.S.2   ...
                                     └── veth <tag>v200 ═ eth0 10.215.S.201 (etcd)

Each host has its own address and loopback; a host is partitioned by taking its veth's
root end down. ``S`` and ``tag`` come from the test's pid, so concurrent runs do not collide.
:meth:`Hosts.destroy` kills every process left in the namespaces and deletes namespaces,
links and the bridge; it is safe to call after a partial set-up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field


class NetnsUnavailable(Exception):
    """Namespaces cannot be made here (not root, no ip, or a sandbox forbids it)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can (a probe namespace is made
    and deleted)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"kvprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Hosts:
    """Namespaced hosts on one bridge (see the module docstring)."""

    tag: str = field(default_factory=lambda: f"k{os.getpid() % 100000}")
    subnet: int = field(default_factory=lambda: 10 + os.getpid() % 240)
    names: dict[str, int] = field(default_factory=dict)  # host name -> index
    bridge_up: bool = False

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def address(self, name: str) -> str:
        return f"10.215.{self.subnet}.{self.names[name] + 1}"

    def namespace(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a process on host ``name``."""
        return ["ip", "netns", "exec", self.namespace(name)]

    def _veth(self, name: str) -> str:
        return f"{self.tag}v{self.names[name]}"

    def create_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.bridge_up = True
        _ip("addr", "add", f"10.215.{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, name: str, index: int) -> str:
        """Make host ``name`` (address 10.215.S.index+1); return its address."""
        self.names[name] = index
        ns, veth, peer = self.namespace(name), self._veth(name), f"{self.tag}p{index}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("-n", ns, "link", "set", peer, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", veth, "master", self.bridge, "up")
        return self.address(name)

    def set_link(self, name: str, up: bool) -> None:
        """Connect or partition host ``name`` (its veth's root end up or down)."""
        _ip("link", "set", self._veth(name), "up" if up else "down")

    def destroy(self) -> list[str]:
        """Kill what runs in the namespaces, delete them, the links and the bridge; return
        what could not be removed (empty when all went)."""
        left = []
        for name in list(self.names):
            ns = self.namespace(name)
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("link", "del", self._veth(name), check=False)  # its peer goes with it
            if _ip("netns", "del", ns, check=False).returncode != 0:
                left.append(ns)
        if self.bridge_up and _ip("link", "del", self.bridge, check=False).returncode != 0:
            left.append(self.bridge)
        self.names.clear()
        self.bridge_up = False
        return left
