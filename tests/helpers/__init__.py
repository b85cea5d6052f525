"""What the test modules share, by topic; no test module imports another.

    models.py      tiny random checkpoints (transformers' own classes), a trained sub-word
                   tokenizer, HF's greedy reference
    server.py      `vllm-launch` as a real process tree; waiting on processes
    streams.py     many client streams at once, with an optional kill in the middle
    engine.py      the offline engine's greedy tokens for a batch of prompts
    scheduler.py   the scheduler driven step by step with fabricated sampled tokens
    fp8.py         FP8 references: compressed-tensors checkpoints, fake quantization, the FP8 KV
                   cache's rounding in transformers, perplexity
    structured.py  the structured-output constraints and their prompts
    gpu.py         the engine on a GPU against HF on the same GPU (needs CUDA)
    kernels.py     the CUDA kernels' inputs, tolerances and paged batches (needs CUDA and cupy)

Fixtures stay in conftest.py files, where pytest finds them.
"""

import pkgutil

import pytest

# The helpers' asserts report their operands as a test module's do (pytest rewrites them). This
# must run before a helper module is imported, which importing this package first guarantees;
# the package itself (being imported) is left out, or pytest warns that it cannot rewrite it.
pytest.register_assert_rewrite(*(f"{__name__}.{module.name}" for module in pkgutil.iter_modules(__path__)))
