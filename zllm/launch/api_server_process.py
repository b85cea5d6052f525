"""One API server of `vllm-launch --api-server-count` (zllm/launch/api_servers.py starts it): the
frontend of its share of the data-parallel engines, served exactly as vllm-launch serves one
(zllm/launch/service.py), in a child process that dies with vllm-launch."""

from __future__ import annotations

import asyncio
import sys

from zllm.launch.service import serve_until_signal
from zllm.procs.children import die_with_parent, read_config_from_stdin, setup_child_logging


def main() -> int:
    config = read_config_from_stdin()
    die_with_parent(config.heartbeat_interval_s)
    setup_child_logging(f"frontend{config.api_server_rank}")
    return asyncio.run(serve_until_signal(config))


if __name__ == "__main__":
    sys.exit(main())
