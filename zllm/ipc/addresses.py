"""Where sockets live. Local links are ipc:// paths in a private 0700 directory, unique per
engine instance; tcp:// is used only where the user asks for it (e.g. a remote client endpoint)."""

from __future__ import annotations

import ipaddress
import os
import tempfile


def runtime_base() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


def default_client_endpoint() -> str:
    """The client endpoint `vllm-launch` binds and `Client()` connects to when none is given."""
    return f"ipc://{runtime_base()}/zllm-{os.getuid()}.sock"


def api_server_endpoint(endpoint: str, api_server_rank: int) -> str:
    """The client endpoint of API server k behind `vllm-launch --api-server-count`: server 0 binds
    the endpoint as given, server k > 0 the next port (tcp://host:port + k) or a sibling file
    (ipc:///dir/name.sock -> ipc:///dir/name.k.sock)."""
    if api_server_rank == 0:
        return endpoint
    path = ipc_path(endpoint)
    if path is not None:
        root, extension = os.path.splitext(path)
        return f"ipc://{root}.{api_server_rank}{extension}"
    if endpoint.startswith("tcp://"):
        address, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{address}:{int(port) + api_server_rank}"
    raise ValueError(f"client_endpoint: {endpoint!r} gives no endpoint per API server: use ipc:// or tcp://host:port")


def make_private_runtime_dir() -> str:
    """A fresh directory only this user can enter (mkdtemp creates it 0700)."""
    path = tempfile.mkdtemp(prefix="zllm-", dir=runtime_base())
    os.chmod(path, 0o700)
    return path


def engine_runtime_dir(runtime_dir: str, generation: int, dp_rank: int = 0) -> str:
    """A fresh directory (inside the private runtime dir) for each start of each engine core:
    a restarted core and its workers share no socket, and no stale message, with a dead one or
    with another data-parallel engine."""
    return os.path.join(runtime_dir, f"engine-{generation}" if dp_rank == 0 else f"dp{dp_rank}-engine-{generation}")


def is_loopback_tcp(endpoint: str) -> bool:
    """A tcp:// endpoint on a loopback address (127.0.0.0/8, [::1], localhost): no other machine
    can connect to it, but every user of this one can (unlike an ipc:// file, nothing checks who).
    A wildcard (*), an interface name or any other address counts as reachable from the network."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


class InternalEndpoints:
    """The engine's own links, all inside its private runtime directory."""

    def __init__(self, runtime_dir: str) -> None:
        self.runtime_dir = runtime_dir

    @property
    def core_input(self) -> str:  # frontend -> engine core
        return f"ipc://{self.runtime_dir}/core-input"

    @property
    def core_output(self) -> str:  # engine core -> frontend
        return f"ipc://{self.runtime_dir}/core-output"

    def worker_input(self, rank: int) -> str:  # engine core -> worker `rank`
        return f"ipc://{self.runtime_dir}/worker-{rank}-input"

    @property
    def worker_output(self) -> str:  # workers -> engine core
        return f"ipc://{self.runtime_dir}/worker-output"


class NodeEndpoints:
    """The head node's tcp endpoints for multi-node tensor parallelism, all derived from
    master_addr:master_port, so every node computes the same ones from its flags.

        master_port       torch.distributed's rendezvous (TCPStore, on tp rank 0)
        master_port + 1   the node channel: headless nodes join the head's frontend
        master_port + 2   workers -> engine core (the remote ranks' outputs)
        master_port + 3 + r   engine core -> tp rank r (remote ranks only)
    or, when whole engines run on other nodes (data parallelism across nodes):
        master_port + 2 + 2d  frontend -> engine core d     master_port + 3 + 2d  engine core d -> frontend
    """

    def __init__(self, master_addr: str, master_port: int) -> None:
        self.host = f"[{master_addr}]" if ":" in master_addr else master_addr
        self.port = master_port

    @property
    def rendezvous(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def node_channel(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"

    @property
    def worker_output(self) -> str:
        return f"tcp://{self.host}:{self.port + 2}"

    def worker_input(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.port + 3 + rank}"

    def engine_input(self, dp_rank: int) -> str:
        return f"tcp://{self.host}:{self.port + 2 + 2 * dp_rank}"

    def engine_output(self, dp_rank: int) -> str:
        return f"tcp://{self.host}:{self.port + 3 + 2 * dp_rank}"
