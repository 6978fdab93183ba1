"""The engine core: the schedule -> execute -> update loop (engine_core.py), the
EngineClient protocol, data parallelism, the scheduler (sched/), host KV
bookkeeping (kv/) and multi-host lockstep (multihost/)."""
