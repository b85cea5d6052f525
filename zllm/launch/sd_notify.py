"""systemd's notify protocol (sd_notify(3)), written to $NOTIFY_SOCKET directly.

The protocol is one datagram of newline-separated `KEY=VALUE` lines on the unix socket named by
$NOTIFY_SOCKET (a leading '@' means Linux's abstract namespace). We send READY=1 once the server
answers, WATCHDOG=1 while the engine makes progress, STOPPING=1 when a drain begins, and STATUS=
lines that `systemctl status` shows. Outside systemd (no $NOTIFY_SOCKET) every call is a no-op.
Behind several API servers, each one's notifications go to vllm-launch's NotifyRelay, which tells
systemd READY=1 once all are ready and WATCHDOG=1 while all feed it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct

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


class NotifyRelay:
    """A $NOTIFY_SOCKET of our own for child processes (the API servers of vllm-launch
    --api-server-count): it learns which child pid said READY=1 and which sent WATCHDOG=1, from
    the kernel's credentials of each datagram (SO_PASSCRED), as systemd itself does."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ready: set[int] = set()
        self.watchdog: set[int] = set()  # pids that sent WATCHDOG=1 since the last take_watchdog()
        self._changed = asyncio.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(path)
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._receive)

    async def wait_ready(self, pids: set[int]) -> None:
        """Return once every one of these pids has sent READY=1."""
        while not pids <= self.ready:
            self._changed.clear()
            await self._changed.wait()

    def take_watchdog(self, pids: set[int]) -> bool:
        """Has every one of these pids sent WATCHDOG=1 since the last call that returned True?"""
        if not pids <= self.watchdog:
            return False
        self.watchdog.clear()
        return True

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()

    def _receive(self) -> None:
        while True:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(_CREDENTIALS.size))
            except (BlockingIOError, InterruptedError):
                return
            pid = next(
                (_CREDENTIALS.unpack(d)[0] for level, kind, d in ancillary if kind == socket.SCM_CREDENTIALS), None
            )
            lines = data.decode(errors="replace").splitlines()
            if pid is not None and "READY=1" in lines:
                self.ready.add(pid)
            if pid is not None and "WATCHDOG=1" in lines:
                self.watchdog.add(pid)
            self._changed.set()


_CREDENTIALS = struct.Struct("iII")  # struct ucred: pid, uid, gid
