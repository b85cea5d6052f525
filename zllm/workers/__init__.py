"""The worker process (entry point: process.py): one rank's model shard and KV cache, the model's
ops (torch references, CUDA and CPU kernels in kernels/), CUDA graphs, weight loading, sampler."""
