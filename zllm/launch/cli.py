"""`vllm-launch`: start the engine on a model.

Until the process split lands, the engine runs in this process and the command completes
prompts given with --prompt (or one per line on standard input) and prints the results.
"""

from __future__ import annotations

import argparse
import logging
import sys

from zllm.launch.args import add_engine_args, engine_kwargs

logger = logging.getLogger("zllm.launch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-launch", description="zllm: serve a Llama-family model")
    add_engine_args(parser)
    smoke = parser.add_argument_group("one-shot generation")
    smoke.add_argument("--prompt", action="append", default=None, help="prompt to complete (repeatable); "
                       "without it, prompts are read one per line from standard input")
    smoke.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    smoke.add_argument("--max-tokens", type=int, default=64)
    smoke.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run_prompts(args)
    except ValueError as error:
        logger.error("%s", error)
        return 2


def _run_prompts(args: argparse.Namespace) -> int:
    from zllm import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    llm = LLM(args.model, **engine_kwargs(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"### {prompt}\n{completion.text}\n[{completion.finish_reason}, {len(completion.token_ids)} tokens]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
