"""`vllm-launch run-batch -i requests.jsonl -o results.jsonl [engine flags]`: an OpenAI batch file
run offline, with a progress bar, one output line per input line (zllm/frontend/openai/batch.py).

The same processes as a server, without the HTTP API: this process is the frontend (its engine
core and workers are children, supervised and restarted as usual), and each line is an
in-process client of the frontend server, as an HTTP request would be.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
from pathlib import Path

from zllm.launch.args import add_engine_args, engine_kwargs

logger = logging.getLogger("zllm.launch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-launch run-batch", description="run an OpenAI batch file offline")
    parser.add_argument("-i", "--input-file", required=True, help="the batch file: one JSON request per line")
    parser.add_argument("-o", "--output-file", required=True, help="where the results go, one JSON line per request")
    parser.add_argument(
        "--max-concurrency", type=int, default=256, help="lines in flight at once (the engine batches them)"
    )
    add_engine_args(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str]) -> int:
    from zllm import envs
    from zllm.config import EngineConfig
    from zllm.ipc.addresses import make_private_runtime_dir
    from zllm.procs.log import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging("frontend", args.log_level)
    envs.set_default("ZLLM_LOG_LEVEL", args.log_level)
    if args.max_concurrency < 1:
        logger.error("max_concurrency: must be >= 1, got %d", args.max_concurrency)
        return 2
    runtime_dir = make_private_runtime_dir()
    try:
        lines = Path(args.input_file).read_text().splitlines()
        config = EngineConfig.create(
            args.model,
            usage="offline",
            **engine_kwargs(args),
            client_endpoint=f"ipc://{runtime_dir}/batch.sock",  # private: never another server's
            runtime_dir=runtime_dir,
        )
        return asyncio.run(_run(config, lines, Path(args.output_file), args.max_concurrency))
    except (ValueError, OSError) as error:
        logger.error("%s", error)
        return 2
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


async def _run(config, lines: list[str], output: Path, max_concurrency: int) -> int:
    from tqdm import tqdm

    from zllm.frontend.openai.batch import run_batch
    from zllm.frontend.server import CoreStartError, FrontendServer
    from zllm.procs.racing import cancel_and_wait, race

    server = FrontendServer(config)
    serving: asyncio.Task | None = None
    try:
        await server.start()
        serving = asyncio.create_task(server.serve(), name="serve")
        with tqdm(total=sum(1 for line in lines if line.strip()), desc="run-batch", unit="req") as bar:
            batch = asyncio.create_task(run_batch(server, lines, lambda: bar.update(1), max_concurrency))
            await race(batch, serving, keep=(serving,))
        if batch.cancelled():  # the serving loop ended first: the engine failed for good
            logger.error("the engine failed for good: %s", server.dead_reason)
            return 1
        output.write_bytes(b"".join(line + b"\n" for line in batch.result()))
        logger.info("wrote %d results to %s", len(batch.result()), output)
        return 0
    except CoreStartError as error:
        logger.error("%s", error)
        return 1
    finally:
        if serving is not None:
            await cancel_and_wait(serving)
        await server.shutdown()
