"""One error path for the command line: every failure prints one line `error: [code] message`, rc 2 for what a
user can fix (bad arguments, a wrong folder, a taken port, peers that do not answer), rc 1 for a defect; with
`--verbose` the traceback comes first. Ctrl-C prints `interrupted` (rc 130), SIGTERM `terminated` (rc 143), after
the command has stopped what it started.
"""

from __future__ import annotations

import argparse
import errno
import sys
import traceback

from nesa_node.errors import NesaError

USER_ERROR = 2
INTERNAL_ERROR = 1
INTERRUPTED = 130
TERMINATED = 128 + 15


class Terminated(SystemExit):
    """SIGTERM in a command without a signal handler of its own: unwinds like Ctrl-C, so `finally` blocks and
    context managers stop what the command started (sessions, child processes, p2pd). A SystemExit, so that an
    event loop running when it arrives lets it through (asyncio logs and drops other exceptions of callbacks)."""


def raise_terminated(signum, frame) -> None:
    raise Terminated(TERMINATED)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line in the CLI's form (subcommand parsers inherit the class)."""

    def error(self, message: str):
        print(f"error: [usage] {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(USER_ERROR)


def describe(exc: BaseException) -> tuple[str, str, int]:
    """(code, message, exit status) for an exception that ended a command."""
    if isinstance(exc, NesaError):
        return exc.code, exc.message, USER_ERROR
    name = type(exc).__name__
    text = str(exc).strip() or name
    if name in ("P2PDaemonError", "ControlFailure", "P2PHandlerError"):  # hivemind's, from p2pd
        return "p2p", f"the p2p daemon failed: {text}", USER_ERROR
    if isinstance(exc, TimeoutError):
        return "timeout", f"{text}: a peer or the network did not answer in time; try again", USER_ERROR
    if isinstance(exc, OSError):
        if exc.errno == errno.EADDRINUSE:
            return "port_in_use", f"{text}; pick another port, or 0 for any free one", USER_ERROR
        if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
            return "file", text, USER_ERROR
        return "os", text, USER_ERROR
    if isinstance(exc, ValueError):
        return "bad_value", text, USER_ERROR
    return "internal", f"{name}: {text} (a defect: run again with --verbose for the traceback)", INTERNAL_ERROR


def report(exc: BaseException, verbose: bool) -> int:
    """Print the failure (traceback first when `verbose`) and return the exit status."""
    if isinstance(exc, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    if isinstance(exc, Terminated):
        print("terminated", file=sys.stderr)
        return TERMINATED
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    code, message, status = describe(exc)
    print(f"error: [{code}] {' '.join(message.split())}", file=sys.stderr)
    return status
