"""Process plumbing shared by every zllm process: starting and stopping children, dying with the
parent, reading the config from stdin, the one logging set-up.

It sits below the processes (frontend, engine core, workers) and imports none of them, nor
zllm/launch: docs/architecture.md, "Imports".
"""
