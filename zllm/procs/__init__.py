"""Process plumbing shared by every zllm process: starting children and, in a child, dying with
the parent and reading the config from stdin (children.py); watching processes exit and killing
them (exits.py); one engine's processes (engine_processes.py); racing asyncio tasks (racing.py);
the one logging set-up (log.py).

It sits below the processes (frontend, engine core, workers) and imports none of them, nor
zllm/launch: docs/architecture.md, "Imports".
"""
