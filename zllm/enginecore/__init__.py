"""The engine-core process: scheduler, KV block pool, request state machine, busy loop."""
