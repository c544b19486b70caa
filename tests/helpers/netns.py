"""A small network of namespaces for fleet tests: hosts on one bridge, no route out.

:class:`Fabric` makes a namespace that holds a bridge and, for each host, a namespace whose
``eth0`` is one end of a veth pair whose other end is on the bridge. Addresses are
``10.213.N.x/24`` with ``N`` unique to the fabric. Nothing is added to the test's own
namespace: the hosts reach each other and nothing else. ``run_in(host)`` gives the command
prefix that runs a process in a host's network namespace only (``nsenter --net``), so a FUSE
mount it makes is visible to the test; servers use ``ip netns exec``. :meth:`Fabric.close`
deletes every namespace it made (their links go with them). Processes started in them are
their starters' to end, before.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from dataclasses import dataclass

_fabrics = itertools.count()


def _ip(*args: str) -> str:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def _ip_tc(netns: str, *args: str) -> None:
    res = subprocess.run(
        ["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {res.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    netns: str
    ip: str

    def run_in(self) -> list[str]:
        """Prefix for a command that joins this host's network namespace only."""
        return ["nsenter", f"--net=/run/netns/{self.netns}"]

    def limit_rate(self, rate: str) -> None:
        """Shape what this host sends to ``rate`` (tc's units, e.g. ``80mbit``)."""
        _ip_tc(self.netns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
               "burst", "256kb", "latency", "500ms")  # fmt: skip

    def unlimit_rate(self) -> None:
        """Undo :meth:`limit_rate` (the default queue again)."""
        subprocess.run(
            ["ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True, check=False,
        )  # fmt: skip

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link (headers included), from the kernel's count."""
        (link,) = json.loads(_ip("-n", self.netns, "-s", "-j", "link", "show", "eth0"))
        return int(link["stats64"]["tx"]["bytes"])


class Fabric:
    def __init__(self) -> None:
        n = next(_fabrics)
        self.prefix = f"objfs{os.getpid() % 100000}x{n}"
        self.subnet = f"10.213.{(os.getpid() + n) % 250 + 1}"
        self.bridge_ns = f"{self.prefix}-br"
        self.names: list[str] = []
        self.hosts: list[Host] = []
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.names.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add(self, role: str) -> Host:
        index = len(self.hosts) + 1
        host = Host(f"{self.prefix}-{role}", f"{self.subnet}.{index + 1}")
        self._add_ns(host.netns)
        port = f"p{index}"
        _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", host.netns)  # fmt: skip
        _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        self.hosts.append(host)
        return host

    def close(self) -> None:
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self.names.clear()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
