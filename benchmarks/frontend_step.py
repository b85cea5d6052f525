"""The frontend's CPU per engine step with N streams open: what one process does for each step's
outputs, without an engine (the engine's messages are made up, so nothing else is timed).

    python benchmarks/frontend_step.py [--model DIR] [--streams 256] [--steps 200] [--engines 1]

N chat completions stream over the OpenAI path (ChatCall.chunks, every chunk encoded as the
HTTP layer encodes it, the bytes dropped instead of written to a socket). Each step, an
EngineOutputs with one new token for every stream goes through the codec (encode + decode, as
over the socket) and into the server as the engine link hands it over; the step ends when every
stream has encoded its chunk. Reports the frontend's time per step (median, p90) and per token:
it must stay below the GPU's step time (docs/benchmarks.md) or the frontend paces the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time


async def run(args) -> dict:
    import msgspec

    from zllm.config import EngineConfig
    from zllm.frontend.openai.protocol import ChatCompletionRequest
    from zllm.frontend.openai.serving import ChatCall
    from zllm.frontend.server import FrontendServer
    from zllm.ipc.codec import Codec
    from zllm.ipc.messages import CoreToFrontend, EngineOutputs, TokenDelta

    config = EngineConfig.create(args.model, data_parallel_size=args.engines, port=0)
    server = FrontendServer(config)
    vocab = [i for i in range(1000, 30000)]
    rng = random.Random(0)
    codec = Codec(CoreToFrontend)
    encoded_bytes = [0]

    async def stream(index: int) -> None:
        body = msgspec.json.encode(
            {
                "messages": [{"role": "user", "content": f"Tell story {index}"}],
                "max_tokens": args.steps,
                "stream": True,
                "ignore_eos": True,
            }
        )
        call = ChatCall.build(server, msgspec.json.decode(body, type=ChatCompletionRequest), config.model_name)
        async with call.engine_call(server) as engine_call:
            async for chunk in call.chunks(server, engine_call):
                encoded_bytes[0] += len(b"data: " + msgspec.json.encode(chunk) + b"\n\n")

    async def streams_caught_up() -> None:
        """Every stream has taken (and encoded) all that the server gave it: between two reads
        of its inbox a stream never waits on anything else."""
        inboxes = [client.inbox for client in server.clients.values() if client.inbox is not None]
        while any(inbox.qsize() for inbox in inboxes):
            await asyncio.sleep(0)
        await asyncio.sleep(0)

    tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
    await asyncio.sleep(0.1)  # every request submitted: its core ids known
    core_ids = {engine.dp_rank: [] for engine in server.engines}
    for request_key, request in server.requests.items():
        core_ids[request.engine.dp_rank] += server.outputs.core_request_ids(request_key)
    assert sum(len(ids) for ids in core_ids.values()) == args.streams, "not every stream was submitted"

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    times = []
    for step in range(args.steps):
        last = step == args.steps - 1
        start = time.perf_counter()
        for engine in server.engines:
            deltas = [
                TokenDelta(core_id, [rng.choice(vocab)], finish_reason="length" if last else None)
                for core_id in core_ids[engine.dp_rank]
            ]
            frame = codec.encode(EngineOutputs(outputs=deltas, num_running=len(deltas)))
            await server._on_engine_message(engine, codec.decode(frame))
        await streams_caught_up()
        times.append(time.perf_counter() - start)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    await asyncio.gather(*tasks)
    await server.shutdown()
    times.sort()
    median = statistics.median(times)
    return {
        "streams": args.streams,
        "steps": args.steps,
        "engines": args.engines,
        "step_ms_median": round(median * 1e3, 3),
        "step_ms_p90": round(times[int(0.9 * len(times))] * 1e3, 3),
        "us_per_token": round(median / args.streams * 1e6, 2),
        "sse_bytes": encoded_bytes[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="its tokenizer and config (default: the embedded SmolLM2)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--engines", type=int, default=1, help="data-parallel engines the outputs come from")
    parser.add_argument("--profile", default=None, help="write a cProfile of the steps (only) to this file")
    print(json.dumps(asyncio.run(run(parser.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
