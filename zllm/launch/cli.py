"""`vllm-launch`: serve a model, or complete a few prompts and exit.

vllm-launch [engine flags] [--zmq-endpoint ipc:///path | tcp://host:port] [--host H --port P]
    starts the frontend (this process), which starts the engine core, which starts the
    workers; serves the ZMQ client endpoint and the OpenAI-compatible HTTP API (default
    http://127.0.0.1:8000) until SIGINT/SIGTERM, which drains: requests in flight finish
    first (zllm/launch/service.py). With --api-server-count A > 1 this process starts and
    supervises A frontends instead, each with its share of the -dp engines (zllm/launch/api_servers.py). The engine is supervised and restarted after a crash
    (zllm/frontend/engines.py, zllm/procs/engine_processes.py); see docs/deployment.md for systemd.
vllm-launch [engine flags] --prompt TEXT [--prompt TEXT ...] [--chat]
    runs the engine in this process, prints the completions, exits.
vllm-launch run-batch -i requests.jsonl -o results.jsonl [engine flags]
    runs an OpenAI batch file (chat completions, completions, responses) offline, with a progress bar, and
    writes one result or error line per request (zllm/launch/run_batch.py).
vllm-launch --headless --nnodes N --node-rank R --master-addr HEAD --master-port P [--zmq-curve-dir DIR]
    runs this node's tp ranks for the head's engine (zllm/launch/node_agent.py); the head is
    `vllm-launch --tp T --nnodes N --node-rank 0 --master-addr HEAD --master-port P ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys

from zllm.launch.args import (
    add_engine_args,
    add_http_args,
    add_node_args,
    add_reliability_args,
    engine_kwargs,
    http_kwargs,
    node_kwargs,
    reliability_kwargs,
)

logger = logging.getLogger("zllm.launch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-launch", description="zllm: serve a Llama-family model")
    add_engine_args(parser)
    serving = parser.add_argument_group("serving")
    serving.add_argument(
        "--zmq-endpoint",
        default="",
        help="client endpoint (default: ipc://$XDG_RUNTIME_DIR-or-/tmp/zllm-<uid>.sock); tcp:// only if you ask",
    )
    serving.add_argument(
        "--runtime-dir",
        default="",
        help="directory for the internal ipc sockets (default: a fresh private one, removed at exit)",
    )
    add_http_args(serving)
    add_reliability_args(parser)
    add_node_args(parser)
    smoke = parser.add_argument_group("one-shot generation (no server)")
    smoke.add_argument("--prompt", action="append", default=None, help="complete this prompt and exit (repeatable)")
    smoke.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    smoke.add_argument("--max-tokens", type=int, default=64)
    smoke.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    from zllm.procs.log import configure_logging

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run-batch"]:
        from zllm.launch.run_batch import main as run_batch

        return run_batch(argv[1:])
    args = build_parser().parse_args(argv)
    configure_logging("node" if args.headless else "frontend", args.log_level)
    try:
        if args.headless:
            from zllm.launch.node_agent import run_node_agent

            return run_node_agent(args)
        if args.prompt:
            return _run_prompts(args)
        return _serve(args)
    except (ValueError, OSError) as error:
        logger.error("%s", error)
        return 2


def _serve(args: argparse.Namespace) -> int:
    import os

    from zllm import envs
    from zllm.config import EngineConfig
    from zllm.ipc.addresses import make_private_runtime_dir
    from zllm.launch.service import serve_until_signal

    envs.set_default("ZLLM_LOG_LEVEL", args.log_level)  # the children this process starts log at this level
    runtime_dir = args.runtime_dir or make_private_runtime_dir()
    if args.runtime_dir:
        os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
        if os.stat(runtime_dir).st_mode & 0o077:
            raise ValueError(f"runtime_dir: {runtime_dir} must be private (mode 0700)")
    try:
        config = EngineConfig.create(
            args.model,
            **engine_kwargs(args),
            **http_kwargs(args),
            **reliability_kwargs(args),
            **node_kwargs(args),
            client_endpoint=args.zmq_endpoint,
            runtime_dir=runtime_dir,
        )
        if config.api_server_count > 1:
            from zllm.launch.api_servers import serve_api_servers

            return asyncio.run(serve_api_servers(config))
        return asyncio.run(serve_until_signal(config))
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _run_prompts(args: argparse.Namespace) -> int:
    from zllm import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    llm = LLM(args.model, **engine_kwargs(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        completion = output.outputs[0]
        print(f"### {prompt}\n{completion.text}\n[{completion.finish_reason}, {len(completion.token_ids)} tokens]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
