"""Process wiring: the vllm-launch CLI, in-process assembly, supervision."""
