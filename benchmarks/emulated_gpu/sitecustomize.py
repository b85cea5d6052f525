"""A virtual GPU under the real engine on a CPU, for host-side experiments (issue 30's dp runs).

    EMULATED_GPU_SCALE=2.5 PYTHONPATH=benchmarks/emulated_gpu:. python benchmarks/throughput.py \\
        --model TINY_LLAMA --dtype float32 --num-prompts 1000 --input-len 256 --output-len 256 \\
        --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 --max-num-seqs 512 \\
        --async-scheduling --dp 2

Python imports this file at start-up in every process whose PYTHONPATH holds its folder (the
frontend, engine cores and workers alike); with EMULATED_GPU_SCALE set, each worker's forward
returns zeros at once, and a virtual device finishes the step at max(now, its previous step's
end) + scale x (3.8 ms + 0.0424 ms per decode row + 0.024 ms per other token): issue 20's H100
profile of the Llama-3-8B shape (docs/benchmarks.md). The worker blocks until then when it reads
the step's tokens, as it would on a GPU. Everything else (frontend, balancer, sockets, scheduler,
the worker's host work) is the real code. Not part of zllm: it patches ModelRunner's privates.
"""

import os

if os.environ.get("EMULATED_GPU_SCALE"):
    import time

    import torch

    from zllm.workers import model_runner

    _SCALE = float(os.environ["EMULATED_GPU_SCALE"])
    _device = {"free_at": 0.0, "last": None}
    _ready: dict[int, float] = {}
    _launch, _finish = model_runner.ModelRunner.launch_step, model_runner.ModelRunner.finish_step

    def _forward(self, batch):
        tokens, decodes = batch.input_ids.shape[0], batch.attention.num_decodes
        cost = _SCALE * (3.8 + 0.0424 * decodes + 0.024 * (tokens - decodes)) / 1000
        _device["free_at"] = max(time.monotonic(), _device["free_at"]) + cost
        _device["last"] = _device["free_at"]
        return torch.zeros(tokens, self.spec.hidden_size, dtype=self.dtype)

    def _launch_step(self, step):
        _device["last"] = None
        launched = _launch(self, step)
        if _device["last"] is not None:
            _ready[launched.step_id] = _device["last"]
        return launched

    def _finish_step(self, launched):
        delay = _ready.pop(launched.step_id, 0.0) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return _finish(self, launched)

    model_runner.ModelRunner._forward = _forward
    model_runner.ModelRunner.launch_step = _launch_step
    model_runner.ModelRunner.finish_step = _finish_step
