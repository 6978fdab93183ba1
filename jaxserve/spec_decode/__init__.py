"""Speculative decoding: configuration (config.py), n-gram proposals on the host
(ngram.py), device drafters for `self` and `draft_model` (draft.py: host side,
draft_inputs.py: the k draft steps' inputs, draft_step.py: their jitted programs),
verification inside the jitted step (rejection.py: deterministic proposals;
rejection_general.py: exact rejection sampling for drafts with a distribution q) and
counters (stats.py).
How a step carries proposals: worker/step_inputs.py (logit rows), scheduler.py
(budget, rollback), core/engine_core.py (which steps speculate)."""
