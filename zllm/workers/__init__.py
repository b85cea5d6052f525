"""The worker process: model shard, KV cache tensors, attention, sampler."""
