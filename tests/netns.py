"""Two "hosts" on one machine, for the tests that run a cluster across hosts
(test_ray_two_nodes.py, test_launch.py): two Linux network namespaces joined by a veth
pair, each with one address of a private range that exists only inside them, so
nothing the test sends leaves the machine.

It needs root and iproute2 (``ip netns``), as CI has; elsewhere `two_hosts` skips the
test, saying why.  Whatever happens, it kills every process left in each namespace
(``ip netns pids``: only the test's own live there) and deletes the namespaces, which
takes the veth pair with them.  The commands are those in docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Host:
    """A namespace: its name (for ``ip netns exec``), its address, and its end of the
    veth pair (``GLOO_SOCKET_IFNAME``)."""

    ns: str
    address: str
    interface: str

    def exec(self, *command: str) -> list[str]:
        """``command`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *command]

    def pids(self) -> list[int]:
        """Every process in the namespace now."""
        return [int(p) for p in sh("ip", "netns", "pids", self.ns).stdout.split()]


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def kill_namespace_processes(ns: str) -> None:
    """SIGTERM then SIGKILL every process in namespace ``ns`` (all of them the test's)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in sh("ip", "netns", "pids", ns).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while pids and time.monotonic() < deadline:
            if not sh("ip", "netns", "pids", ns).stdout.split():
                return
            time.sleep(0.2)


@contextlib.contextmanager
def two_hosts(prefix: str, address_a: str, address_b: str) -> Iterator[tuple[Host, Host]]:
    """Namespaces ``{prefix}-a-PID`` and ``{prefix}-b-PID`` joined by a veth pair, with
    ``address_a`` and ``address_b`` (a /24) on its ends and loopback up in each."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2) to build network namespaces")
    if os.geteuid() != 0:
        pytest.skip("building network namespaces needs root")
    tag = f"{os.getpid() % 100000}"
    a = Host(f"{prefix}-a-{tag}", address_a, f"{prefix[:4]}a{tag}")
    b = Host(f"{prefix}-b-{tag}", address_b, f"{prefix[:4]}b{tag}")
    made = []
    try:
        for host in (a, b):
            result = sh("ip", "netns", "add", host.ns)
            if result.returncode:
                pytest.skip(f"`ip netns add` failed: {result.stderr.strip()}")
            made.append(host.ns)
        steps = [
            ("ip", "link", "add", a.interface, "netns", a.ns, "type", "veth",
             "peer", "name", b.interface, "netns", b.ns),
        ]  # fmt: skip
        for host in (a, b):
            steps += [
                ("ip", "-n", host.ns, "addr", "add", f"{host.address}/24", "dev", host.interface),
                ("ip", "-n", host.ns, "link", "set", host.interface, "up"),
                ("ip", "-n", host.ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            result = sh(*step)
            if result.returncode:
                pytest.skip(f"`{' '.join(step)}` failed: {result.stderr.strip()}")
        yield a, b
    finally:
        for ns in made:
            kill_namespace_processes(ns)
            sh("ip", "netns", "del", ns)  # takes the veth pair with it
