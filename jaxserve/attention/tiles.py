"""Query tiles: each row's run of new tokens cut into tiles of Qt tokens (host side).

    row 0: 37 tokens -> tiles [0..15] [16..31] [32..36 + 11 empty]
    row 1:  1 token  -> tile  [37 + 15 empty]
    ...     unused tiles point at the padding row and hold no tokens

A prefill chunk then gathers its context blocks once per tile rather than once per
token (Qt-fold less gathered memory); decodes still cost one tile each. The tile count
C = min(T, R + T // Qt) bounds every layout a (T, R) bucket can hold.
"""
from __future__ import annotations

import numpy as np

QUERY_TILE = 16


def num_tiles(T: int, R: int, qt: int = QUERY_TILE) -> int:
    return min(T, R + T // qt)


def build_query_tiles(qsl: np.ndarray, num_rows: int, T: int, R: int,
                      qt: int = QUERY_TILE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    C = num_tiles(T, R, qt)
    tile_rows = np.full(C, R, np.int32)
    tile_tokens = np.full((C, qt), T, np.int32)
    token_slot = np.zeros(T, np.int32)      # padding tokens read any slot (output unused)
    c = 0
    for r in range(num_rows):
        a, b = int(qsl[r]), int(qsl[r + 1])
        for start in range(a, b, qt):
            n = min(qt, b - start)
            tile_rows[c] = r
            tile_tokens[c, :n] = np.arange(start, start + n)
            token_slot[start:start + n] = c * qt + np.arange(n)
            c += 1
    assert c <= C, (c, C)
    return tile_rows, tile_tokens, token_slot
