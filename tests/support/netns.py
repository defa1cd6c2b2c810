"""A shaped link for tests: a network namespace joined to this one by a veth pair whose two ends are limited with
`tc tbf` (this kernel has no netem; bandwidth is what tbf shapes). Processes started with `ip netns exec` inside
reach this namespace at `outer_ip` and are reached at `inner_ip`. Everything is removed on exit."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def can_shape() -> str | None:
    """None when this machine can make shaped namespaces, else why not (the test skips with it)."""
    if os.geteuid() != 0:
        return "needs root for ip netns and tc"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command (iproute2)"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@dataclass
class ShapedNamespace:
    rate_mbit: float
    name: str = ""
    outer_ip: str = ""
    inner_ip: str = ""

    def __enter__(self) -> ShapedNamespace:
        tag = os.getpid() % 100_000
        self.name = f"nesa-shaped-{tag}"
        outer, inner = f"nso{tag}", f"nsi{tag}"
        subnet = f"10.213.{tag % 250}"
        self.outer_ip, self.inner_ip = f"{subnet}.1", f"{subnet}.2"
        self._outer = outer
        try:
            _run("ip", "netns", "add", self.name)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", self.name)
            _run("ip", "addr", "add", f"{self.outer_ip}/24", "dev", outer)
            _run("ip", "link", "set", outer, "up")
            inside = ("ip", "netns", "exec", self.name)
            _run(*inside, "ip", "addr", "add", f"{self.inner_ip}/24", "dev", inner)
            _run(*inside, "ip", "link", "set", inner, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            shape = ("root", "tbf", "rate", f"{self.rate_mbit}mbit", "burst", "64kb", "latency", "200ms")
            _run("tc", "qdisc", "add", "dev", outer, *shape)
            _run(*inside, "tc", "qdisc", "add", "dev", inner, *shape)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def command(self, *args: str) -> list[str]:
        """`args` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *args]

    def __exit__(self, *exc_info) -> None:
        subprocess.run(["ip", "link", "del", self._outer], capture_output=True, timeout=30)  # both veth ends
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


@dataclass
class Host:
    """One machine of a Switch: a network namespace with one interface on the switch's subnet."""

    namespace: str
    ip: str

    def command(self, *args: str) -> list[str]:
        """`args` run on this host (the command execs them: its pid is theirs)."""
        return ["ip", "netns", "exec", self.namespace, *args]


class Switch:
    """Machines on one LAN: a namespace holding a bridge, and per `host` a namespace joined to it by a veth pair,
    optionally shaped to `rate_mbit` both ways with `tc tbf`; `attach_here` joins this process's namespace too (for
    an in-process client). Names carry this process's pid; every namespace and veth made is removed on exit, also
    when setting up fails."""

    def __init__(self, subnet: str):
        self.tag = os.getpid() % 100_000
        self.subnet = subnet  # three octets, e.g. "10.214.7"
        self.bridge_ns = f"nesa-lan-{self.tag}"
        self.namespaces: list[str] = []
        self.here_veth: str | None = None
        self._count = 0

    def __enter__(self) -> Switch:
        try:
            self._add_namespace(self.bridge_ns)
            inside = ("ip", "netns", "exec", self.bridge_ns)
            _run(*inside, "ip", "link", "add", "br0", "type", "bridge")
            _run(*inside, "ip", "link", "set", "br0", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")

    def _veth(self, rate_mbit: float | None) -> tuple[str, str, str]:
        """A veth pair whose outer end is on the bridge: (inner end's name, in this namespace for now; its IP)."""
        self._count += 1
        outer, inner = f"nlo{self.tag}x{self._count}", f"nli{self.tag}x{self._count}"
        ip = f"{self.subnet}.{self._count + 1}"
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        try:
            _run("ip", "link", "set", outer, "netns", self.bridge_ns)
        except BaseException:
            subprocess.run(["ip", "link", "del", outer], capture_output=True, timeout=30)
            raise
        bridge = ("ip", "netns", "exec", self.bridge_ns)
        _run(*bridge, "ip", "link", "set", outer, "master", "br0")
        _run(*bridge, "ip", "link", "set", outer, "up")
        if rate_mbit is not None:
            _run(*bridge, "tc", "qdisc", "add", "dev", outer, *_tbf(rate_mbit))
        return inner, ip, outer

    def host(self, name: str, *, rate_mbit: float | None = None) -> Host:
        """A new machine on the LAN, its link shaped to `rate_mbit` when given."""
        namespace = f"nesa-{name}-{self.tag}"
        self._add_namespace(namespace)
        inner, ip, _ = self._veth(rate_mbit)
        _run("ip", "link", "set", inner, "netns", namespace)
        inside = ("ip", "netns", "exec", namespace)
        _run(*inside, "ip", "addr", "add", f"{ip}/24", "dev", inner)
        _run(*inside, "ip", "link", "set", inner, "up")
        if rate_mbit is not None:
            _run(*inside, "tc", "qdisc", "add", "dev", inner, *_tbf(rate_mbit))
        return Host(namespace, ip)

    def attach_here(self) -> str:
        """Join this process's own namespace to the LAN; its IP there."""
        inner, ip, _ = self._veth(None)
        self.here_veth = inner
        _run("ip", "addr", "add", f"{ip}/24", "dev", inner)
        _run("ip", "link", "set", inner, "up")
        return ip

    def leftovers(self) -> list[str]:
        """Namespaces and interfaces of this switch still present (none after exit)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
        names = [line.split()[0] for line in listed.splitlines() if line.strip()]
        return [name for name in names if name.endswith(f"-{self.tag}") and name.startswith("nesa-")] + [
            line.split(":")[1].strip() for line in links.splitlines() if f"{self.tag}x" in line
        ]

    def __exit__(self, *exc_info) -> None:
        if self.here_veth is not None:  # deleting one end removes the pair
            subprocess.run(["ip", "link", "del", self.here_veth], capture_output=True, timeout=30)
        for name in reversed(self.namespaces):  # a namespace takes its interfaces with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.namespaces.clear()


def _tbf(rate_mbit: float) -> tuple[str, ...]:
    return ("root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "200ms")
