"""Vision-language figures (issue 35) on Qwen2.5-VL-7B's shape with dummy weights.

    python benchmarks/dummy_model.py qwen2.5-vl-7b /tmp/qwen2.5-vl-7b
    python benchmarks/vision.py --model /tmp/qwen2.5-vl-7b --load-format dummy

Every request is one 1024 x 768 picture (random pixels, a new one per request unless said) and 64
text tokens (4 before the image, 60 after: the 4 differ per request, so no prefix-cache block
ever covers an image and the encoder cache alone decides whether an image is encoded again).

1. ttft: one request, max_tokens 1, through LLM.generate (the image processor in the frontend,
   the vision tower and the prefill), median of --iters, each with a new picture.
2. throughput: --requests requests at once, --output-len tokens each (ignore_eos): requests/s
   and output tokens/s; then the same requests without their images (64 text tokens).
3. encoder_cache: the same requests all with one picture: the encoder runs once, every other
   request reads the encoder cache (its queries and hits are printed).
The pictures are made and the prompts built before the clock starts; the image processor's time
per picture is printed apart (it runs inside the timed generate calls too).
Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def picture(seed: int, width: int, height: int):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def text(rng: random.Random, count: int) -> str:
    return " ".join(f"t{rng.randrange(1000, 100000)}" for _ in range(count))


def prompts(count: int, images: list | None, seed: int) -> list:
    """count prompts: 4 words, the image (images[i % len(images)]), 60 words; None: the 64 words alone."""
    rng = random.Random(seed)
    made = []
    for index in range(count):
        head, tail = text(rng, 4), text(rng, 60)
        if images is None:
            made.append({"prompt": f"{head} {tail}"})
        else:
            made.append(
                {"prompt": f"{head} {PLACEHOLDER} {tail}", "multi_modal_data": {"image": images[index % len(images)]}}
            )
    return made


def main() -> None:
    from zllm import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--only", choices=["ttft", "throughput", "encoder_cache"], default=None)
    args = parser.parse_args()

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    size = (args.width, args.height)
    llm.generate(
        prompts(2, [picture(10**6 + 1, *size), picture(10**6 + 2, *size)], seed=3), first, use_tqdm=False
    )  # warm-up

    images = llm.engine.processor.images
    started = time.perf_counter()
    expanded, inputs = images.expand([images.vision.image_token_id], [picture(10**6 + 3, *size)])
    print(
        json.dumps(
            {
                "figure": "image_processor",
                "ms_per_picture": round((time.perf_counter() - started) * 1e3, 1),
                "image_tokens": inputs[0].length,
                "patches": int(inputs[0].pixel_values.shape[0]),
            }
        )
    )

    if args.only in (None, "ttft"):
        times = []
        for i in range(args.iters):
            batch = prompts(1, [picture(1000 + i, *size)], seed=1000 + i)
            started = time.perf_counter()
            llm.generate(batch, first, use_tqdm=False)
            times.append(time.perf_counter() - started)
        print(
            json.dumps(
                {
                    "figure": "ttft",
                    "ms_median": round(statistics.median(times) * 1e3, 1),
                    "ms_all": [round(t * 1e3, 1) for t in times],
                }
            )
        )

    def run(name: str, batch: list) -> None:
        before = llm.engine.core.stats()
        started = time.perf_counter()
        outputs = llm.generate(batch, full, use_tqdm=False)
        elapsed = time.perf_counter() - started
        after = llm.engine.core.stats()
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(
            json.dumps(
                {
                    "figure": name,
                    "requests": len(batch),
                    "seconds": round(elapsed, 2),
                    "requests_per_s": round(len(batch) / elapsed, 2),
                    "output_tokens_per_s": round(generated / elapsed, 1),
                    "encoder_cache_queries": after.encoder_cache_queries - before.encoder_cache_queries,
                    "encoder_cache_hits": after.encoder_cache_hits - before.encoder_cache_hits,
                }
            )
        )

    if args.only in (None, "throughput"):
        pictures = [picture(i, *size) for i in range(args.requests)]
        run("throughput_images", prompts(args.requests, pictures, seed=1))
        del pictures
        run("throughput_text_only", prompts(args.requests, None, seed=1))
    if args.only in (None, "encoder_cache"):
        run("encoder_cache_one_image", prompts(args.requests, [picture(7, *size)], seed=2))
    llm.shutdown()


if __name__ == "__main__":
    main()
