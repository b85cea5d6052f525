"""The one socket helper: every zmq socket of the zllm processes is made here (the client library
makes its own DEALER: zllm/client.py), and the link of a child process to the one that drives it
(`connect_pull_push`: ipc, or tcp with CURVE from another node) is connected here.

Bounded high-water marks (back-pressure instead of unbounded queues) and linger 0 (closing
never blocks on unsent messages to a dead peer).
"""

from __future__ import annotations

import os
import socket as pysocket
from collections.abc import Callable

import zmq

from zllm.ipc.addresses import ipc_path
from zllm.ipc.curve import ClientKeys, ServerKeys, load_node_keys, make_curve_client, make_curve_server


def make_socket(
    context: zmq.Context,
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    hwm: int,
    identity: bytes | None = None,
    router_mandatory: bool = False,
    curve_server_keys: ServerKeys | None = None,
    curve_client_keys: ClientKeys | None = None,
    max_message_bytes: int = -1,
) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    if router_mandatory:
        # Sending to a peer that went away raises EHOSTUNREACH instead of dropping silently:
        # that is how the frontend notices a vanished client.
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if max_message_bytes > 0:
        # A peer that sends a bigger frame is disconnected before the frame is buffered. Only for
        # sockets that bind: libzmq ends a connecting socket's session on an oversized frame and
        # never reconnects it (check the size on receipt there: Codec's max_frame_bytes).
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if curve_server_keys is not None:
        make_curve_server(socket, curve_server_keys)
    if curve_client_keys is not None:
        make_curve_client(socket, curve_client_keys.server_public, curve_client_keys.key_pair)
    if bind:
        path = ipc_path(endpoint)
        if path is not None and os.path.exists(path):
            if _someone_listens(path):
                socket.close(linger=0)
                raise OSError(f"{endpoint} is in use by another running process")
            os.unlink(path)  # a stale socket file left by a dead instance
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)
    return socket


def connect_pull_push(
    context: zmq.Context, receive_from: str, send_to: str, *, hwm: int, curve_dir: str
) -> tuple[zmq.Socket, zmq.Socket]:
    """A process's link to the one that drives it (worker to engine core, engine core to
    frontend): a PULL connected to `receive_from` and a PUSH to `send_to`. ipc:// on the same
    node; tcp:// from another node, with this node's CURVE keys from curve_dir (none given:
    --allow-insecure-tcp)."""
    tcp = receive_from.startswith("tcp://")
    keys = load_node_keys(curve_dir) if tcp and curve_dir else None
    return (
        make_socket(context, zmq.PULL, receive_from, bind=False, hwm=hwm, curve_client_keys=keys),
        make_socket(context, zmq.PUSH, send_to, bind=False, hwm=hwm, curve_client_keys=keys),
    )


def send_watching(socket: zmq.Socket, frame: bytes, poll_ms: int, check: Callable[[], None]) -> None:
    """Send, waiting for room as long as it takes, but never for a peer that is gone: a PUSH
    socket whose only peer died blocks a plain send forever. Between waits of poll_ms, check()
    looks at the peer (or the sender's own state) and raises to give up."""
    while True:
        try:
            socket.send(frame, zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        check()
        socket.poll(poll_ms, zmq.POLLOUT)


def _someone_listens(path: str) -> bool:
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
