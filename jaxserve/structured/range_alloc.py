"""First-fit allocation of contiguous index ranges [start, start + n) in [0, capacity).

The device automaton pool gives each constraint one contiguous run of state rows and
one of exception entries; this tracks the free runs (sorted, adjacent ones merged).
"""
from __future__ import annotations

import bisect


class RangeAllocator:
    __slots__ = ("capacity", "_starts", "_lens")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []   # free runs, sorted by start
        self._lens: list[int] = [capacity] if capacity else []

    @property
    def num_free(self) -> int:
        return sum(self._lens)

    def alloc(self, n: int) -> int | None:
        """Start of a free run of n (n = 0: always 0), or None if none is long enough."""
        if n == 0:
            return 0
        for i, (s, length) in enumerate(zip(self._starts, self._lens)):
            if length >= n:
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i], self._lens[i] = s + n, length - n
                return s
        return None

    def free(self, start: int, n: int) -> None:
        if n == 0:
            return
        assert 0 <= start and start + n <= self.capacity, (start, n)
        i = bisect.bisect_left(self._starts, start)
        assert i == len(self._starts) or start + n <= self._starts[i], "double free"
        assert i == 0 or self._starts[i - 1] + self._lens[i - 1] <= start, "double free"
        self._starts.insert(i, start)
        self._lens.insert(i, n)
        if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:   # merge right
            self._lens[i] += self._lens.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:        # merge left
            self._lens[i - 1] += self._lens.pop(i)
            self._starts.pop(i)
