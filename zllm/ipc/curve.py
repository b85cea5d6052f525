"""CURVE security for a tcp:// client endpoint: ZeroMQ's CurveZMQ (encryption and authentication).

Keys are ZeroMQ certificate files (`zmq.auth` format: text, z85-encoded keys):

    <curve dir>/             0700, --zmq-curve-dir
      server.key             the server's public key: give a copy to every client
      server.key_secret      the server's key pair (0600): never leaves the server
      clients/<name>.key     public keys of the clients allowed to connect

The server's key pair is generated at its first start when missing. A client proves who it is
with its own key pair; the server accepts the public keys found in `clients/` (read again at
every connection, so adding or removing a file takes effect without a restart). With no client
key there, the server accepts any client that completes the handshake (knows the server's
public key) *only* when `--api-key` is set, which then authenticates every request; with
neither, it refuses to start. `python -m zllm.launch.keys` makes client key pairs.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import zmq
import zmq.auth

from zllm.ipc.addresses import is_loopback_tcp

logger = logging.getLogger("zllm.ipc.curve")

SERVER_NAME = "server"
CLIENTS_DIR = "clients"
_LOG_EVERY_S = 10.0  # a misconfigured client retries every 100 ms: log each kind of refusal this often


@dataclass(frozen=True, slots=True)
class ServerKeys:
    public: bytes
    secret: bytes
    clients_dir: str


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a CURVE client needs: the server's public key and its own key pair."""

    server_public: bytes
    key_pair: tuple[bytes, bytes]


def load_node_keys(curve_dir: str) -> ClientKeys:
    """A headless node's keys (multi-node tp): the head's `server.key` and the node's own key pair,
    the one `*.key_secret` file in `curve_dir` (made by `python -m zllm.launch.keys new-client`
    on the head, which authorizes its public key there)."""
    server_key = os.path.join(curve_dir, f"{SERVER_NAME}.key")
    pairs = sorted(
        p
        for p in glob.glob(os.path.join(curve_dir, "*.key_secret"))
        if os.path.basename(p) != f"{SERVER_NAME}.key_secret"
    )
    if not os.path.exists(server_key):
        raise ValueError(f"zmq_curve_dir: {server_key} is missing: copy the head's {SERVER_NAME}.key there")
    if len(pairs) != 1:
        raise ValueError(
            f"zmq_curve_dir: expected this node's key pair, one *.key_secret file, in {curve_dir}; "
            f"found {len(pairs)} (make one on the head: python -m zllm.launch.keys new-client ...)"
        )
    _require_private(pairs[0], 0o077)
    return ClientKeys(load_public_key(server_key), load_key_pair(pairs[0]))


def load_or_create_server_keys(curve_dir: str) -> ServerKeys:
    """The server's key pair from `curve_dir` (generated on first use, kept private)."""
    with _private_umask():
        os.makedirs(os.path.join(curve_dir, CLIENTS_DIR), mode=0o700, exist_ok=True)
        secret_path = os.path.join(curve_dir, f"{SERVER_NAME}.key_secret")
        if not os.path.exists(secret_path):
            zmq.auth.create_certificates(curve_dir, SERVER_NAME)
            logger.info(
                "generated the CURVE server key pair in %s; clients need %s",
                curve_dir,
                os.path.join(curve_dir, f"{SERVER_NAME}.key"),
            )
    _require_private(curve_dir, 0o077)
    _require_private(secret_path, 0o077)
    public, secret = load_key_pair(secret_path)
    return ServerKeys(public, secret, os.path.join(curve_dir, CLIENTS_DIR))


def client_endpoint_keys(endpoint: str, curve_dir: str, api_key: str | None) -> ServerKeys | None:
    """The CURVE keys a client endpoint binds with (None: no CURVE). ValueError when CURVE is
    asked for but no client could ever be authenticated (no client key on file, no api key)."""
    if not curve_dir:
        if endpoint.startswith("tcp://"):
            who = "any local user can connect" if is_loopback_tcp(endpoint) else "anyone who reaches it can connect"
            logger.warning(
                "%s serves without CURVE (--allow-insecure-tcp): %s; traffic%s is in clear text",
                endpoint,
                who,
                " and the api key" if api_key else "",
            )
        return None
    keys = load_or_create_server_keys(curve_dir)
    if not authorized_client_keys(keys.clients_dir) and api_key is None:
        raise ValueError(
            f"zmq_curve_dir: no client is authorized: put client public keys in {keys.clients_dir} "
            "(python -m zllm.launch.keys new-client ...) or set --api-key"
        )
    return keys


def create_client_keys(curve_dir: str, name: str, out_dir: str) -> tuple[str, str]:
    """A new client key pair: its public key authorized in `curve_dir`/clients, its key pair
    (to hand to the client) in `out_dir`. Returns (public key path, key pair path)."""
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"name: {name!r} must be a plain file name")
    clients_dir = os.path.join(curve_dir, CLIENTS_DIR)
    with _private_umask():
        os.makedirs(clients_dir, mode=0o700, exist_ok=True)
        os.makedirs(out_dir, mode=0o700, exist_ok=True)
        public_path, secret_path = zmq.auth.create_certificates(out_dir, name)
    authorized = os.path.join(clients_dir, f"{name}.key")
    os.replace(public_path, authorized)
    return authorized, secret_path


def load_key_pair(path: str) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"CURVE key pair: cannot read {path}: {error}") from None
    if secret is None:
        raise ValueError(f"CURVE key pair: {path} holds no secret key (that is a public .key file)")
    return public, secret


def load_public_key(path: str) -> bytes:
    try:
        return zmq.auth.load_certificate(path)[0]
    except (OSError, ValueError) as error:
        raise ValueError(f"CURVE public key: cannot read {path}: {error}") from None


def authorized_client_keys(clients_dir: str) -> set[bytes]:
    keys = set()
    for path in sorted(glob.glob(os.path.join(clients_dir, "*.key"))):
        try:
            keys.add(load_public_key(path))
        except ValueError as error:
            logger.error("%s", error)
    return keys


def make_curve_server(socket: zmq.Socket, keys: ServerKeys) -> None:
    """Before bind: the socket speaks CURVE as a server."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True


def make_curve_client(socket: zmq.Socket, server_public: bytes, key_pair: tuple[bytes, bytes] | None) -> None:
    """Before connect: the socket speaks CURVE to a server with that public key. Without a key
    pair of its own the client uses a fresh one (accepted only by servers that allow any key)."""
    public, secret = key_pair or zmq.curve_keypair()
    socket.curve_serverkey = server_public
    socket.curve_publickey = public
    socket.curve_secretkey = secret


class ClientKeyCheck:
    """The ZAP callback (zmq.auth's credentials provider): is this client's key authorized?"""

    def __init__(self, clients_dir: str, allow_any_when_empty: bool) -> None:
        self.clients_dir = clients_dir
        # Only when every request must carry an api key may a server with no client key on file
        # let any CURVE client through the handshake.
        self.allow_any_when_empty = allow_any_when_empty
        self._last_logged = 0.0

    def callback(self, domain: str, client_key: bytes) -> bool:
        authorized = authorized_client_keys(self.clients_dir)
        if client_key in authorized or (not authorized and self.allow_any_when_empty):
            return True
        now = time.monotonic()
        if now - self._last_logged > _LOG_EVERY_S:
            self._last_logged = now
            logger.warning(
                "refused a client: CURVE key %s is not in %s", client_key.decode(errors="replace"), self.clients_dir
            )
        return False


def start_authenticator(context: zmq.Context, check: ClientKeyCheck):
    """Run ZeroMQ's authentication handler (ZAP) for `context` on the running asyncio loop."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    authenticator = AsyncioAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=check)
    return authenticator


def start_thread_authenticator(context: zmq.Context, check: ClientKeyCheck):
    """ZeroMQ's authentication handler (ZAP) for a plain (threaded) context; stop() it before the
    context goes."""
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=check)
    return authenticator


_BAD_HANDSHAKE = (
    "the security handshake failed: the server uses CURVE and this client does not (give "
    "server_key=), or the other way round, or server_key is not the server's public key"
)
# libzmq reports a mechanism mismatch or a wrong server key as either of the last two events.
_HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused this client's CURVE key (not among its authorized clients)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: _BAD_HANDSHAKE,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: _BAD_HANDSHAKE,
}

HANDSHAKE_FAILURE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def describe_handshake_failure(event: int) -> str | None:
    """A monitor event -> why the handshake failed, in words (None: not a handshake failure)."""
    return _HANDSHAKE_FAILURES.get(event)


def _require_private(path: str, forbidden_bits: int) -> None:
    if os.stat(path).st_mode & forbidden_bits:
        raise ValueError(f"CURVE keys: {path} must be readable by its owner only (chmod go-rwx {path})")


@contextmanager
def _private_umask():
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)
