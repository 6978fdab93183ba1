"""The scheduler: token budget, chunked prefill, preemption, its output (the
diff a step needs), waiting queues and token-level stops."""
