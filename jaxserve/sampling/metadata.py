"""SamplingMetadata: the per-row sampling settings of one step, as a jit-friendly pytree.

Glossary: R rows (padded), V vocab, B = LOGIT_BIAS_WIDTH, E = STOP_IDS_WIDTH.

Every field is an array (the scalar flags are 0-d), so a new mix of settings is new data,
never a new compilation. Padding rows are greedy with everything off. Sparse tables are
padded with token id V, which the device drops (scatter mode="drop").

The flags let the jitted sampler skip work that no row of the step needs (lax.cond on
them, or, on GPU, a program chosen on the host from them: sampler.SamplerPlan); they
never change what a row gets, only whether the work is done.
"""
from __future__ import annotations

from typing import Sequence

from flax import struct
import jax
import numpy as np

from jaxserve.sampling.params import MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOP_IDS, SamplingParams

LOGIT_BIAS_WIDTH = MAX_LOGIT_BIAS
STOP_IDS_WIDTH = MAX_MIN_TOKENS_STOP_IDS + 8   # + the model's EOS ids
GREEDY_EPS = 1e-5                              # temperatures below this are greedy (vLLM)
TOPK_CAP = 128     # largest top_k served by truncation's fast path; also the top-p pool


def num_candidates(vocab: int) -> int:
    """C: the sorted candidates truncation.py reads top-k / top-p off."""
    return min(TOPK_CAP + 1, vocab)


@struct.dataclass
class SamplingMetadata:
    temperature: jax.Array         # [R] f32, 0 = greedy
    top_k: jax.Array               # [R] int32, 0 = off
    top_p: jax.Array               # [R] f32, 1 = off
    min_p: jax.Array               # [R] f32, 0 = off
    presence_penalty: jax.Array    # [R] f32
    frequency_penalty: jax.Array   # [R] f32
    repetition_penalty: jax.Array  # [R] f32, 1 = off
    seed: jax.Array                # [R, 2] uint32 (hi, lo) words of the 64-bit seed
    has_seed: jax.Array            # [R] bool
    output_pos: jax.Array          # [R] int32 index of the sampled token in the output
    min_tokens: jax.Array          # [R] int32 stop ids are suppressed while output_pos < this
    stop_ids: jax.Array            # [R, E] int32 EOS + stop_token_ids (pad V)
    bias_ids: jax.Array            # [R, B] int32 logit_bias token ids (pad V)
    bias_values: jax.Array         # [R, B] f32
    all_greedy: jax.Array          # [] bool: no row samples
    any_truncation: jax.Array      # [] bool: some sampling row uses top_k/top_p/min_p
    any_penalty: jax.Array         # [] bool: some row has a non-neutral penalty
    any_bias: jax.Array            # [] bool: some row has logit_bias or suppressed stop ids
    any_exact: jax.Array           # [] bool: some sampling row may need the exact threshold
                                   #    search (top_k >= C, or top_p without a top_k < C)
    # speculative decoding (spec_decode/): [R, W] int32 the proposals before this row's
    # position, counted as outputs by the penalties (pad V); None when not configured
    prev_draft_ids: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


def build_sampling_metadata(params: Sequence[SamplingParams | None], output_lens: Sequence[int],
                            eos_ids: Sequence[tuple[int, ...]], num_rows_padded: int,
                            vocab_size: int) -> SamplingMetadata:
    """Host (numpy) builder, run every step. Row r gets params[r] (None: padding, greedy)
    sampling the token at output position output_lens[r]; eos_ids[r] are the model's EOS
    ids for it (suppressed with its stop_token_ids while under min_tokens)."""
    R, V = num_rows_padded, vocab_size
    assert len(params) <= R and len(output_lens) == len(params) == len(eos_ids)
    temp = np.zeros(R, np.float32)
    top_k = np.zeros(R, np.int32)
    top_p = np.ones(R, np.float32)
    min_p = np.zeros(R, np.float32)
    pres = np.zeros(R, np.float32)
    freq = np.zeros(R, np.float32)
    rep = np.ones(R, np.float32)
    seed = np.zeros((R, 2), np.uint32)
    has_seed = np.zeros(R, bool)
    out_pos = np.zeros(R, np.int32)
    min_tok = np.zeros(R, np.int32)
    stop_ids = np.full((R, STOP_IDS_WIDTH), V, np.int32)
    bias_ids = np.full((R, LOGIT_BIAS_WIDTH), V, np.int32)
    bias_vals = np.zeros((R, LOGIT_BIAS_WIDTH), np.float32)
    suppress_any = False
    for r, (p, n_out, eos) in enumerate(zip(params, output_lens, eos_ids)):
        out_pos[r] = n_out
        if p is None:
            continue
        if p.temperature >= GREEDY_EPS:
            temp[r] = p.temperature
            top_k[r] = min(p.top_k, V) if p.top_k > 0 else 0
            top_p[r] = p.top_p
            min_p[r] = p.min_p
        pres[r], freq[r], rep[r] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        if p.seed is not None:
            s = p.seed % (1 << 64)
            seed[r] = (s >> 32, s & 0xFFFFFFFF)
            has_seed[r] = True
        if p.logit_bias:
            ids = list(p.logit_bias)
            bias_ids[r, :len(ids)] = ids
            bias_vals[r, :len(ids)] = [p.logit_bias[t] for t in ids]
        if p.min_tokens > n_out:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
            assert len(ids) <= STOP_IDS_WIDTH, "more stop ids than STOP_IDS_WIDTH"
            stop_ids[r, :len(ids)] = ids
            min_tok[r] = p.min_tokens
            suppress_any = suppress_any or bool(ids)
    sampling = temp > 0
    k_on = (top_k > 0) & (top_k < V)
    k_small = k_on & (top_k < num_candidates(V))
    may_exact = sampling & ((k_on & ~k_small) |
                            ((top_p < 1) & ~k_small & (num_candidates(V) < V)))
    return SamplingMetadata(
        temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
        presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep,
        seed=seed, has_seed=has_seed, output_pos=out_pos, min_tokens=min_tok,
        stop_ids=stop_ids, bias_ids=bias_ids, bias_values=bias_vals,
        all_greedy=np.bool_(not sampling.any()),
        any_truncation=np.bool_((sampling & ((top_k > 0) | (top_p < 1) | (min_p > 0))).any()),
        any_penalty=np.bool_((pres != 0).any() or (freq != 0).any() or (rep != 1).any()),
        any_bias=np.bool_(suppress_any or bool((bias_ids < V).any())),
        any_exact=np.bool_(may_exact.any()),
    )
