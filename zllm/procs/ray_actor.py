"""A process placed by Ray (the Ray backend, zllm/enginecore/ray_executor.py): one actor per tp
rank, in a bundle of the engine's placement group. It reports where it landed (node, address,
GPUs), then runs a module's entry named by its path, as spawn_child names one
(zllm/procs/children.py): the worker loop itself lives in zllm/workers/process.py and talks to
its engine core over ZeroMQ. Only plain values (str, int, bytes of msgspec JSON) cross Ray's
channel: Ray places and watches the process, it never carries a step.
"""

from __future__ import annotations

import importlib
import os
import socket


class ModuleActor:
    def where(self) -> dict[str, str | int | list[str]]:
        """The Ray node, its address and the GPUs Ray gave this actor."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    def free_port(self) -> int:
        """A port free on this node now (rank 0's torch.distributed rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def run(self, module: str, function: str, *args: str | int | bytes | None) -> int:
        """Run `module.function(*args)` here until it returns (its exit code)."""
        return getattr(importlib.import_module(module), function)(*args)
