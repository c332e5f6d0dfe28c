"""What a generation step's llama_decode costs: the forward passes llama.cpp splits a batch
into, and the time of a pass by its rows, measured on this machine.

A split KV cache (a stream per slot) makes llama.cpp cut a batch into ubatches that each take
the same number of tokens from a run of consecutive sequences (``split_equal`` with
``sequential``, vendored llama-batch.cpp), and each ubatch is a forward pass of its own. So a
step where one slot carries a draft of 8 and seven slots one token each is two passes (8
rows, then 8 more), which cost about what 8 + 8 rows cost apart, not what 16 rows cost
together: on Gemma 3 270M, one thread, 8 slots, 212 ms against 109 ms for the 8 tokens alone
and 134 ms for 16 rows in one pass (docs/performance.md). A unified cache, or one slot, is
one pass. Drafting decisions (engine/speculation/policy.py) price a batch through ``BatchCost``.

Pure Python, no llama call: the split is computed here the way llama.cpp does it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["BatchCost", "StepCost", "batch_counts", "ubatch_rows"]


def ubatch_rows(counts: Sequence[int], n_ubatch: int, split: bool) -> list[int]:
    """The rows of each forward pass llama.cpp makes of a batch whose sequences, in sequence
    id order and consecutive (a gap between ids splits like a sequence with nothing left),
    carry ``counts`` tokens each (0: not in the batch). ``split``: a stream per sequence
    (``split_equal``); else one pass per ``n_ubatch`` rows (``split_simple``)."""
    total = sum(counts)
    if not split:
        return [min(n_ubatch, total - i) for i in range(0, total, n_ubatch)]
    left = list(counts)
    passes: list[int] = []
    first = 0
    n = len(left)
    while True:
        while first < n and not left[first]:
            first += 1
        if first == n:
            return passes
        end = first + 1  # the run of consecutive sequences with tokens left
        while end < n and left[end] and end - first < n_ubatch:
            end += 1
        width = end - first
        take = max(1, min(min(left[first:end]), n_ubatch // width))
        for i in range(first, end):
            left[i] -= take
        passes.append(take * width)


def batch_counts(slots: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """The ``counts`` of ``ubatch_rows`` for steps in ``slots`` (ascending) with ``tokens``
    each: one entry per sequence id from the first slot to the last, 0 in the gaps."""
    counts = [0] * (slots[-1] - slots[0] + 1)
    for slot, n in zip(slots, tokens, strict=True):
        counts[slot - slots[0]] = n
    return counts


class StepCost:
    """The mean llama_decode time of a forward pass, per number of rows (the positions with
    logits: the streams' tokens and their drafts), from the engine's recent generation steps
    that were one pass. Not a line: on a CPU with repacked weights the matrix kernels take
    rows in blocks, so the cost rises in steps (Gemma 3 270M, one thread: 8 rows cost less
    than 7, docs/performance.md), and every size that runs is measured. A size not measured
    lately is estimated from its measured neighbours: between two, on the line joining them;
    up to twice the largest, as the largest (the optimistic guess, which sends the plan there
    once to measure it, so the sizes in use grow by doublings), and in proportion past that;
    below the smallest, not at all.

    A size counts as measured from its second decode on: llama.cpp's first pass of a new
    shape also sizes its buffers (Gemma 3 270M, 8 slots of 9 rows: 1,081 ms the first time,
    639 after), so the first is held back, and the lower of the two starts the mean.

    Worker only (updated and read there); read at scrape time for /metrics (plain floats)."""

    WEIGHT = 0.2  # the latest decode's weight in its size's mean
    STALE_STEPS = 1 << 16  # a size not measured for this many steps is measured anew

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}  # rows -> mean seconds (bounded by n_batch)
        self._first: dict[int, float] = {}  # rows -> the first decode's seconds, not yet counted
        self._seen: dict[int, int] = {}  # rows -> the step it was last measured at
        self._sizes: list[int] = []  # the measured sizes, ascending
        self.steps = 0

    def add(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self._seen[rows] = self.steps
        mean = self._mean.get(rows)
        if mean is not None:
            self._mean[rows] = mean + self.WEIGHT * (seconds - mean)
        elif rows not in self._first:
            self._first[rows] = seconds
        else:
            self._mean[rows] = min(seconds, self._first.pop(rows))
            bisect.insort(self._sizes, rows)
        if self.steps % self.STALE_STEPS == 0:
            stale = [r for r, at in self._seen.items() if self.steps - at > self.STALE_STEPS]
            for r in stale:
                del self._seen[r]
                self._mean.pop(r, None)
                self._first.pop(r, None)
            if stale:
                self._sizes = sorted(self._mean)

    def measured(self) -> dict[int, float]:
        """rows -> mean seconds, of the sizes measured lately (a copy)."""
        return dict(self._mean)

    def estimate(self, rows: int) -> float | None:
        """A pass of ``rows`` rows: its mean, else from its measured neighbours; None below
        the smallest measured size."""
        mean = self._mean.get(rows)
        if mean is not None:
            return mean
        sizes = self._sizes
        at = bisect.bisect_left(sizes, rows)
        if at == 0:
            return None
        lo = sizes[at - 1]
        if at == len(sizes):
            return self._mean[lo] * max(1.0, rows / (2 * lo))
        hi = sizes[at]
        return self._mean[lo] + (self._mean[hi] - self._mean[lo]) * (rows - lo) / (hi - lo)


class BatchCost:
    """A step's cost from its passes (``ubatch_rows``) and each pass's measured cost
    (``StepCost``): what the draft plan compares. Built per step on the worker."""

    def __init__(self, cost: StepCost, n_ubatch: int, split: bool) -> None:
        self._cost = cost
        self._n_ubatch = n_ubatch
        self._split = split

    def passes(self, counts: Sequence[int]) -> list[int]:
        return ubatch_rows(counts, self._n_ubatch, self._split)

    def one_pass_of_singles(self, first: int, last: int, n: int) -> bool:
        """Whether ``n`` sequences, ``first`` to ``last`` (ascending), one token each, are one
        forward pass: what ``len(passes(...)) == 1`` says of them, without the counts."""
        return n <= self._n_ubatch and (not self._split or last - first + 1 == n)

    def seconds(self, counts: Sequence[int]) -> float | None:
        """The step's estimated seconds; None when a pass's size has no estimate yet."""
        total = 0.0
        for rows in self.passes(counts):
            est = self._cost.estimate(rows)
            if est is None:
                return None
            total += est
        return total
