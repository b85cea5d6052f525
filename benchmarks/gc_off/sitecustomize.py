"""Python's cyclic garbage collector off in every process whose PYTHONPATH holds this folder.

    PYTHONPATH=benchmarks/gc_off:$PYTHONPATH vllm-launch ...     (run_perf.sh's servemodel part)

An A/B switch for a served run's latency tails (issue 40): a collection of the oldest generation
pauses the frontend, the engine core or a worker while it walks every tracked object, which
delays every request of that moment at once. Reference counting still frees what a run makes;
only cycles stay, for the length of a benchmark. Not part of zllm.
"""

import gc

gc.disable()
