"""The service manager's notification protocol (systemd's sd_notify, `Type=notify`): a long-running command tells its
supervisor it is ready, that it is alive, and that it is stopping, by datagrams to the Unix socket named in
`NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without that variable every call does nothing.

- READY=1 once the command serves (a node: its blocks loaded and its record announced), with a STATUS line;
- WATCHDOG=1 every half of `WATCHDOG_USEC` while the event loop runs (a loop stuck for longer misses its beat and
  the supervisor restarts the service), when `WATCHDOG_PID` is unset or names this process;
- STOPPING=1 when a signal starts the shutdown (a node drains its sessions, then exits).

A supervisor that cannot be reached is logged once and otherwise ignored: notifications never stop the command.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

logger = logging.getLogger(__name__)

__all__ = ["Notifier"]


class Notifier:
    """Notifications to the supervisor named by `environ` (default os.environ)."""

    def __init__(self, environ: dict[str, str] | None = None):
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.watchdog_s: float | None = None
        usec, pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._failed = False
        self._beats: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str) -> bool:
        """Send one notification, e.g. `send(READY="1", STATUS="serving")`; False when there is no supervisor or it
        cannot be reached."""
        if not self.enabled:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                sock.sendall(message)
            return True
        except OSError as exc:
            if not self._failed:
                self._failed = True
                logger.warning("cannot notify the service manager at NOTIFY_SOCKET (%s): %s", self.address, exc)
            return False

    def ready(self, status: str) -> None:
        """READY=1 with `status`, and the watchdog's beats from now on (when the supervisor asked for them)."""
        self.send(READY="1", STATUS=status, MAINPID=str(os.getpid()))
        if self.watchdog_s is not None and self._beats is None:
            self._beats = asyncio.ensure_future(self._beat(self.watchdog_s / 2))

    def stopping(self, status: str) -> None:
        self.send(STOPPING="1", STATUS=status)

    def close(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
            self._beats = None

    async def _beat(self, period_s: float) -> None:
        while True:
            self.send(WATCHDOG="1")
            await asyncio.sleep(period_s)
