"""Embeddings from a decoder: which pooling a model uses, the device program that pools a
step's final hidden states, and the host's last touches (normalisation, Matryoshka cut).

A decoder (Llama, Qwen3...) serves as an embedder when the engine runs with
`task="embed"`, or, with `task="auto"`, when its checkpoint is a sentence-transformers
model (modules.json listing a Pooling module whose 1_Pooling/config.json chooses
`pooling_mode_lasttoken` or `pooling_mode_mean_tokens`, and a Normalize module for unit
vectors). `pooler_config` (vLLM's keys: {"pooling_type": "LAST"|"MEAN", "normalize":
bool}) overrides either. A model with `task="embed"` and no such file pools the last
token and normalises (vLLM's default for decoder embedders).

The embedding is the pooled output of the final norm (no LM head): the last prompt
token's, or the mean over every prompt token. A prompt longer than one step arrives in
chunks, so the device program returns per-row SUMS of normed hidden states over the
tokens the host marks, and the host adds the chunks up (mean: divided by the prompt
length at the end; last: only the final token is ever marked).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import decoder

TASKS = ("auto", "generate", "embed")
POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    pooling_type: str           # "last" | "mean"
    normalize: bool             # unit vectors (and again after a `dimensions` cut)


def sentence_transformers_pooling(model_dir: str | Path | None) -> PoolingConfig | None:
    """The pooling a sentence-transformers checkpoint declares, or None (not one, or a
    pooling mode jaxserve does not serve: a decoder pools last or mean)."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not root.is_dir() or not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    if "Pooling" not in kinds:
        return None
    pool_cfg = json.loads((root / kinds["Pooling"] / "config.json").read_text())
    if pool_cfg.get("pooling_mode_lasttoken"):
        mode = "last"
    elif pool_cfg.get("pooling_mode_mean_tokens"):
        mode = "mean"
    else:
        raise ValueError(f"{root}: the sentence-transformers pooling {pool_cfg} is not "
                         f"served (a decoder embedder pools the last token or the mean)")
    return PoolingConfig(mode, "Normalize" in kinds)


def resolve_pooling(task: str, pooler_config: dict | None,
                    model_dir: str | Path | None) -> PoolingConfig | None:
    """The engine's pooling (None: a generation model), from EngineArgs.task,
    EngineArgs.pooler_config and the checkpoint directory."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if task == "generate":
        return None
    found = sentence_transformers_pooling(model_dir)
    if found is None and task == "auto":
        return None
    return apply_pooler_config(found or PoolingConfig("last", True), pooler_config)


def pooling_from_args(args: Any) -> PoolingConfig | None:
    """resolve_pooling for EngineArgs (its task, pooler_config and model)."""
    return resolve_pooling(args.task, args.pooler_config, args.model)


def apply_pooler_config(base: PoolingConfig, pooler_config: dict | None) -> PoolingConfig:
    """base with vLLM-style overrides ({"pooling_type": "LAST"|"MEAN", "normalize":
    bool}); ValueError for anything else."""
    over = dict(pooler_config or {})
    unknown = set(over) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config: unknown keys {sorted(unknown)} (known: "
                         f"pooling_type, normalize)")
    mode = str(over.get("pooling_type", base.pooling_type)).lower()
    if mode not in POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type must be LAST or MEAN, got {mode!r}")
    normalize = over.get("normalize", base.normalize)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    return PoolingConfig(mode, normalize)


class PoolingProgram:
    """(head weights, hidden [T, D], rows [T] int32) -> sums [S, D] float32: row r's sum
    of final-normed hidden states over the tokens t with rows[t] == r (rows[t] == S: not
    pooled). One program per token bucket (compiled at warm-up, like the step)."""

    def __init__(self, cfg: Any, num_rows: int, on_trace: Callable[[], None], *,
                 jit_kwargs: dict | None = None) -> None:
        """hidden: the last layer's output before the final norm (every step form keeps
        it in last_hidden); num_rows: S, the most rows one step has."""
        self.cfg, self.num_rows, self.on_trace = cfg, num_rows, on_trace
        self._fn = jax.jit(self._impl, **(jit_kwargs or {}))

    def _impl(self, head: dict, hidden: jax.Array, rows: jax.Array) -> jax.Array:
        self.on_trace()
        x = decoder.final_norm(head, hidden, self.cfg).astype(jnp.float32)
        sums = jax.ops.segment_sum(x, rows, num_segments=self.num_rows + 1)
        return sums[:self.num_rows]

    def __call__(self, head: dict, hidden: jax.Array, rows: jax.Array) -> jax.Array:
        return self._fn(head, hidden, rows)

    def compile(self, head: dict, hidden: Any, rows: Any) -> None:
        """Compile for these (abstract) shapes ahead of time; nothing runs."""
        self._fn.lower(head, hidden, rows).compile()


def finish_embedding(pooled: np.ndarray, normalize: bool,
                     dimensions: int | None = None) -> np.ndarray:
    """The embedding a client gets (float32): the pooled vector, cut to its first
    `dimensions` values (Matryoshka) and, for a normalising model, scaled to unit
    length after the cut (so a cut vector is a unit vector too)."""
    v = np.asarray(pooled, np.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v
