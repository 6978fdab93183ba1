"""N-gram (prompt lookup) proposals, on the host in numpy.

    tokens:   ... a b c x y z ... a b c | <- the last n tokens (the suffix)
                  ^^^^^ earlier match     proposal = x y z ... (the k tokens after it)

The longest suffix of n tokens (prompt_lookup_max down to prompt_lookup_min) that also
occurs earlier in the request's own tokens (prompt + output) is looked up; its most
recent earlier occurrence gives the proposal. Proposals are deterministic (q is one-hot),
so verification is exact with any target distribution (sampling/rejection.py).
Cost: O(len * n) vectorised compares per request and step, ~20 us at 2k tokens.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k proposed tokens continuing `tokens` ([L] int), or an empty array."""
    L = int(tokens.shape[0])
    if k <= 0 or L < min_n + 1:
        return tokens[:0]
    # Candidate ends: a match ending at j (< L - 1) has a continuation at j + 1. One
    # compare on the last token narrows the search before any window is built.
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
    if ends.size == 0:
        return tokens[:0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        ok = ends[ends >= n - 1]
        if ok.size == 0:
            continue
        if n > 1:
            starts = ok - (n - 1)
            win = sliding_window_view(tokens, n)[starts]          # [M, n]
            ok = ok[np.all(win == tokens[L - n:], axis=1)]
        if ok.size:
            j = int(ok[-1]) + 1
            return tokens[j:j + k]
    return tokens[:0]


class NgramProposer:
    """Proposals for the scheduler: the request's tokens are kept in a growing numpy
    buffer per request, so a step copies only the tokens appended since the last."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._buf: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, req_id: str, prompt: list[int], output: list[int],
                max_k: int) -> list[int]:
        tokens = self._tokens(req_id, prompt, output)
        return propose_ngram(tokens, min(self.k, max_k), self.min_n, self.max_n).tolist()

    def _tokens(self, req_id: str, prompt: list[int], output: list[int]) -> np.ndarray:
        total = len(prompt) + len(output)
        buf, n = self._buf.get(req_id, (None, 0))
        if buf is None or n > total or buf.shape[0] < total:
            new = np.empty(max(2 * total, 64), np.int32)
            keep = min(n, total) if buf is not None else 0
            if keep:
                new[:keep] = buf[:keep]
            buf, n = new, keep
        if n < len(prompt):
            buf[n:len(prompt)] = prompt[n:]
            n = len(prompt)
        if n < total:
            buf[n:total] = output[n - len(prompt):]
        self._buf[req_id] = (buf, total)
        return buf[:total]

    def forget(self, req_id: str) -> None:
        self._buf.pop(req_id, None)
