"""Speculative decoding: configuration (config.py), n-gram proposals on the host
(ngram.py), verification inside the jitted step (rejection.py) and counters (stats.py).
How a step carries proposals: engine/step_inputs.py (logit rows), scheduler.py
(budget, rollback), engine/core.py (which steps speculate)."""
