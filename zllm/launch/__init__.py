"""Process wiring: the vllm-launch CLI, the service's life, in-process assembly, the node agent."""
