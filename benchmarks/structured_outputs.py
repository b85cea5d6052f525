"""What structured outputs cost: one batch of JSON-schema requests vs the same batch unconstrained,
and the grammar compile time per schema.

    python benchmarks/structured_outputs.py --num-prompts 64 --input-len 32 --output-len 64      # CPU, SmolLM2
    python benchmarks/structured_outputs.py --model DIR --load-format dummy --num-prompts 64 \
        --input-len 128 --output-len 256                                                          # GPU

Both runs sample (temperature 1, a seed per request) the same prompts (random ids of real
tokens) to exactly --output-len tokens (ignore_eos). The schema is an object holding an array
of strings with no bound, so a run stays inside the grammar for most of its tokens; the share
of tokens sampled under the grammar (until it ended, if it did) is measured after the run by
replaying each output through an xgrammar matcher. A dummy model needs a real tokenizer for
grammars: `benchmarks/dummy_model.py SHAPE DIR --tokenizer TOKENIZER_DIR`.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

NOTES = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "notes"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "is_capital": {"type": "boolean"},
        "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
    },
    "required": ["city", "country", "is_capital", "continent"],
    "additionalProperties": False,
}
TOOL_CALLS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "anyOf": [
            {
                "properties": {
                    "name": {"enum": ["get_weather"]},
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                        "required": ["city", "unit"],
                    },
                },
                "required": ["name", "parameters"],
            },
            {
                "properties": {
                    "name": {"enum": ["get_time"]},
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                },
                "required": ["name", "parameters"],
            },
        ],
    },
}
SCHEMAS = {"notes": NOTES, "city": CITY, "tool_calls": TOOL_CALLS}


def emit(**fields) -> dict:
    print(json.dumps(fields), flush=True)
    return fields


def tokenizer_info(model_dir: str):
    """xgrammar's view of the model's vocabulary (as the engine core builds it)."""
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=AutoConfig.from_pretrained(model_dir).vocab_size)


def schema_grammar(schema: dict):
    from zllm.grammars import grammar_of
    from zllm.sampling_params import StructuredOutputsParams

    return grammar_of(StructuredOutputsParams(json=schema))


def compile_times(model_dir: str, repeats: int) -> None:
    """Median compile time of each schema against the model's vocabulary (no cache)."""
    import xgrammar as xgr

    start = time.perf_counter()
    info = tokenizer_info(model_dir)
    emit(measure="tokenizer_info", seconds=round(time.perf_counter() - start, 3), vocab=info.vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    for name, schema in SCHEMAS.items():
        grammar = schema_grammar(schema)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            compiler.compile_grammar(grammar)
            times.append(time.perf_counter() - start)
        emit(measure="compile", schema=name, median_ms=round(1000 * statistics.median(times), 2), repeats=repeats)


def constrained_share(model_dir: str, outputs: list[list[int]], eos: list[int]) -> float:
    """The fraction of output tokens sampled while the grammar still constrained them."""
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(tokenizer_info(model_dir)).compile_grammar(schema_grammar(NOTES))
    constrained = 0
    for tokens in outputs:
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=eos)
        for token in tokens:
            constrained += 1
            if not matcher.accept_token(token):
                raise AssertionError(f"an output left the grammar at token {token}")
            if matcher.is_terminated():
                break
    return constrained / sum(len(t) for t in outputs)


def run(args) -> None:
    from transformers import AutoTokenizer

    from zllm import LLM, SamplingParams
    from zllm.model_files import resolve_model_dir
    from zllm.sampling_params import StructuredOutputsParams

    model_dir = str(resolve_model_dir(args.model))
    compile_times(model_dir, args.compile_repeats)
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.num_prompts, 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rng = random.Random(args.seed)
    vocab = len(AutoTokenizer.from_pretrained(model_dir))  # real tokens only (a dummy model's vocab is larger)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    constraint = StructuredOutputsParams(json=NOTES)

    def params(structured: bool) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=1.0,
                seed=args.seed + i,
                max_tokens=args.output_len,
                ignore_eos=True,
                detokenize=False,
                structured_outputs=constraint if structured else None,
            )
            for i in range(args.num_prompts)
        ]

    llm.generate(prompts[:2], params(True)[:2], use_tqdm=False)  # warm-up: graphs, grammar engine, the schema's compile
    results = {}
    for structured in (False, True, False, True):  # twice each, interleaved: the second pair is reported
        start = time.perf_counter()
        outputs = llm.generate(prompts, params(structured), use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert all(len(t) == args.output_len for t in tokens)
        results[structured] = (elapsed, tokens)
    eos = sorted(llm.engine.processor.eos_token_ids)
    share = constrained_share(model_dir, results[True][1], eos)
    total = args.num_prompts * args.output_len
    free, constrained = total / results[False][0], total / results[True][0]
    emit(
        measure="throughput",
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        unconstrained_tok_s=round(free, 1),
        json_schema_tok_s=round(constrained, 1),
        cost_pct=round(100 * (1 - constrained / free), 2),
        share_of_tokens_under_grammar=round(share, 3),
        async_scheduling=llm.engine.config.async_scheduling,
    )
    llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
