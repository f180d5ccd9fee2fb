"""A segment tree for range additions and range maxima over a timeline of steps."""

from __future__ import annotations


class RangeMax:
    """A timeline of numbers with two operations in O(log n): add a value over steps
    ``start .. stop - 1``, and the largest number over such a range. A bottom-up segment tree
    with lazy additions (each inner node holds the max of its children plus what was added to its
    whole range).

    >>> t = RangeMax([3, 1, 4, 1, 5])
    >>> t.add(1, 4, 10)
    >>> t.max(0, 2), t.max(3, 5), t.max(0, 5)
    (11, 11, 14)
    """

    def __init__(self, values):
        values = list(values)
        self.n = n = max(len(values), 1)
        self.height = n.bit_length()
        self.tree = [0] * n + values + [0] * (n - len(values))
        self.pending = [0] * n  # per inner node, what was added to all of its range
        for p in range(n - 1, 0, -1):
            self.tree[p] = max(self.tree[2 * p], self.tree[2 * p + 1])

    def add(self, start: int, stop: int, value: int) -> None:
        lo, hi = start + self.n, stop + self.n
        first, last = lo, hi - 1
        while lo < hi:
            if lo & 1:
                self._apply(lo, value)
                lo += 1
            if hi & 1:
                hi -= 1
                self._apply(hi, value)
            lo, hi = lo >> 1, hi >> 1
        self._rebuild(first)
        self._rebuild(last)

    def max(self, start: int, stop: int) -> int:
        lo, hi = start + self.n, stop + self.n
        self._push(lo)
        self._push(hi - 1)
        best = None
        while lo < hi:
            if lo & 1:
                best = self.tree[lo] if best is None else max(best, self.tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = self.tree[hi] if best is None else max(best, self.tree[hi])
            lo, hi = lo >> 1, hi >> 1
        return best

    def _apply(self, p: int, value: int) -> None:
        self.tree[p] += value
        if p < self.n:
            self.pending[p] += value

    def _rebuild(self, p: int) -> None:
        while p > 1:
            p >>= 1
            self.tree[p] = max(self.tree[2 * p], self.tree[2 * p + 1]) + self.pending[p]

    def _push(self, p: int) -> None:
        for shift in range(self.height, 0, -1):
            i = p >> shift
            if i and self.pending[i]:
                self._apply(2 * i, self.pending[i])
                self._apply(2 * i + 1, self.pending[i])
                self.pending[i] = 0
