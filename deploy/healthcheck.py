#!/usr/bin/env python3
"""The nesa-node image's HEALTHCHECK: exit 0 when the container's nesa-node process serves, 1 otherwise.

It reads the process's own command line (from /proc), so every container of the image is checked by what it runs:
- `run` with --metrics-port: GET /health on that port (the node's event loop answers and the node is not offline);
- `gateway`: GET /health on its --port (default 8000);
- `dht`, or `run` without --metrics-port: its --address-file exists and was written by this process (it is written
  once the peer serves, after its DHT and libp2p host are up), and its --port accepts a TCP connection (the libp2p
  daemon still listens). A bootstrap peer has no HTTP endpoint; these two are what it shows from outside.
- any other command: the process exists.
Standard library only (the image's system Python runs it): no torch import on every check.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 5.0  # each probe; the image's HEALTHCHECK --timeout is larger
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # a listener on all addresses, reached locally


def find_process() -> tuple[int, list[str]] | None:
    """The nesa-node process of this container: (pid, its arguments after `nesa-node`)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for index, arg in enumerate(argv):
            if os.path.basename(arg) == b"nesa-node":
                return int(entry.name), [item.decode(errors="replace") for item in argv[index + 1 :] if item]
    return None


def option(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` (the last one given, as argparse takes it)."""
    value = default
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def started_at(pid: int) -> float:
    """When the process started, seconds since the epoch (boot time plus its start in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # field 22 of proc(5), counted after the command name's closing parenthesis
    boot = next(
        int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
    )
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def check_http(host: str, port: str) -> str | None:
    """None when GET /health answers 200, else why not."""
    host = WILDCARDS.get(host, host)
    url = f"http://[{host}]:{port}/health" if ":" in host else f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            print(f"{url}: {response.status} {response.read(500).decode(errors='replace')}")
            return None
    except urllib.error.HTTPError as error:
        return f"{url}: {error.code} {error.read(500).decode(errors='replace')}"
    except OSError as error:
        return f"{url}: {error}"


def check_listener(pid: int, host: str, port: str | None, address_file: str | None) -> str | None:
    """None when the address file was written by process `pid` and the port accepts TCP, else why not."""
    if address_file:
        try:
            written = os.stat(address_file).st_mtime
        except OSError:
            return f"{address_file} is not written yet"
        if written < started_at(pid) - 1.0:  # boot time has a resolution of one second
            return f"{address_file} is older than the process: not written by this run yet"
    if port and port != "0":
        try:
            socket.create_connection((WILDCARDS.get(host, host), int(port)), timeout=TIMEOUT_S).close()
        except OSError as error:
            return f"port {port}: {error}"
    print(f"{address_file or 'no --address-file'} written, port {port or 'unknown'} listening")
    return None


def main() -> int:
    found = find_process()
    if found is None:
        print("no nesa-node process in this container")
        return 1
    pid, args = found
    command = args[0] if args else ""
    host = option(args, "--host", "127.0.0.1")
    if command == "gateway":
        problem = check_http(host, option(args, "--port", "8000"))
    elif command == "run" and option(args, "--metrics-port") not in (None, "0"):
        problem = check_http(host, option(args, "--metrics-port"))
    elif command in ("run", "dht"):
        problem = check_listener(pid, host, option(args, "--port"), option(args, "--address-file"))
    else:
        print(f"nesa-node {command} is running (pid {pid})")
        problem = None
    if problem is not None:
        print(problem)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
