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
