"""systemd's notify protocol (sd_notify(3)), written to $NOTIFY_SOCKET directly.

The protocol is one datagram of newline-separated `KEY=VALUE` lines on the unix socket named by
$NOTIFY_SOCKET (a leading '@' means Linux's abstract namespace). We send READY=1 once the server
answers, WATCHDOG=1 while the engine makes progress, STOPPING=1 when a drain begins, and STATUS=
lines that `systemctl status` shows. Outside systemd (no $NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger("zllm.launch.sd_notify")


class SystemdNotifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.address = _socket_address(environ.get("NOTIFY_SOCKET", ""))
        self.watchdog_interval_s = _watchdog_interval(environ)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def notify(self, *lines: str) -> None:
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(lines).encode(), self.address)
        except OSError as error:  # systemd gone or socket misconfigured: never fatal to serving
            logger.warning("sd_notify to %s failed: %s", self.address, error)


def _socket_address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value if value.startswith("/") else None  # vsock and others: not supported


def _watchdog_interval(environ) -> float | None:
    """WatchdogSec= as seconds, if the watchdog is meant for this process."""
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1_000_000
