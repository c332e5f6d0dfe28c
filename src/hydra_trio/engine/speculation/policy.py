"""The draft policy of speculative decoding: how long each step's drafts are (one decision
for the whole step: ``step_drafts``, ``plan_drafts``), the accept rule (``verify``), and the
``DraftPlanner`` the backend's steps call (engine/llama/types.py ``StepPlanner``).

Each request offers the continuation of its best match (``Speculation.candidate``) with the
chance that each further position is accepted, and the step takes the draft positions that
make the most tokens per second at the cost measured on this machine (stepcost.py: the
forward passes the batch becomes, and what a pass of so many rows costs). So drafts grow
where they are accepted and rows are cheap, and stop where the batch is already large. The
drafts ride in the same llama_decode as every other slot's step, as extra positions of its
sequence with logits for each; the sampler picks at each position in turn (``verify``), the
longest matching prefix is kept plus the pick after it, and the rejected positions are
removed from the KV (engine/llama/steps.py). Pure Python, no llama call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from .drafter import Speculation
from .stepcost import BatchCost, StepCost, batch_counts

# A draft position this unlikely to be accepted is not worth pricing: at the cheapest a
# verified position costs about a quarter of a one-token step on a CPU (docs/performance.md).
LEAST_WORTH = 0.1

def plan_drafts(
    slots: Sequence[int],
    candidates: Sequence[tuple[int, float, int]],
    cost: BatchCost,
    room: int,
) -> list[int]:
    """The draft length of each step in a batch: the choice that makes the most expected
    tokens per second of the step's decode. ``slots``: the steps' slots, ascending;
    ``candidates``: each step's (candidate draft length, chance each position is accepted
    given the one before, least length it may draft); ``room``: draft positions the batch
    has left. The one draft-length policy.

    A position's worth is the chance that it and every one before it are accepted; positions
    are added in order of worth (across the steps), and the batch of the best ratio of
    expected tokens (each step's own token, plus the worth of its draft positions) to its
    estimated seconds (``cost``: its forward passes, each priced by rows as measured) is
    taken. The step without drafts not measured yet: no drafts (it is measured first)."""
    n = len(slots)
    lengths = [0] * n
    if not n or room <= 0 or not any(k for k, _, _ in candidates):
        return lengths
    base = slots[0]
    counts = batch_counts(slots, [1] * n)  # tokens per sequence id, gaps included (they split passes)
    seconds = cost.seconds(counts)
    if seconds is None or seconds <= 0:
        return lengths
    best_rate, best = n / seconds, list(lengths)
    heap = [(-p, i, 1) for i, (k, p, _) in enumerate(candidates) if k > 0 and p >= LEAST_WORTH]
    heapq.heapify(heap)
    expected = float(n)
    used = 0
    while heap and used < room:
        neg_worth, i, j = heapq.heappop(heap)
        expected -= neg_worth
        lengths[i] = j
        counts[slots[i] - base] += 1
        used += 1
        seconds = cost.seconds(counts)
        if seconds is not None and seconds > 0 and expected / seconds > best_rate:
            best_rate, best = expected / seconds, list(lengths)
        k, p, _ = candidates[i]
        worth = -neg_worth * p
        if j < k and worth >= LEAST_WORTH:
            heapq.heappush(heap, (-worth, i, j + 1))
    return [k if k >= least else 0 for k, (_, _, least) in zip(best, candidates, strict=True)]


def step_drafts(
    slots: Sequence[int],
    streams: Sequence[tuple[Speculation | None, Sequence[int], int, int]],
    cost: BatchCost,
    room: int,
) -> list[list[int]]:
    """The draft each stream of a step verifies. ``slots``: the streams' slots, ascending;
    ``streams``: each one's speculation (None: it does not speculate), its tokens so far, the
    token the step evaluates, and the most it may draft (its tokens left, its slot's room);
    ``room``: draft positions the batch has left. A stream offers its candidate unless the
    step has more streams than its ``max_batch``; ``plan_drafts`` decides how much of each the
    step takes."""
    offers: list[list[int]] = []
    candidates: list[tuple[int, float, int]] = []
    for spec, history, token, most in streams:
        draft: list[int] = []
        chance = 0.0
        cap = min(most, room)
        if spec is not None and cap > 0 and len(streams) <= spec.config.max_batch:
            draft, chance = spec.candidate(history, token, cap)
        offers.append(draft)
        candidates.append((len(draft), chance, spec.config.n_min if spec is not None else 0))
    if not any(offers):
        return offers
    lengths = plan_drafts(slots, candidates, cost, room)
    return [offer[:k] for offer, k in zip(offers, lengths, strict=True)]


def verify(draft: Sequence[int], pick: Callable[[int], int], is_eog: Callable[[int], bool]) -> list[int]:
    """The accept rule: the request's sampler picks at position 0 (the step's own token's
    logits), then at position j+1 only while its pick at j equalled draft j; the picks are
    the step's tokens (the accepted drafts, then the first pick that differs or follows the
    last draft). With point-mass drafts a pick is a draw from the target distribution, so
    keeping the matching prefix and the first differing pick is exact rejection sampling;
    the sampler (its RNG, penalties, grammar) sees only the picks kept, exactly as without
    a draft. An end of generation ends the picks (nothing is sampled after it)."""
    picks: list[int] = []
    for j in range(len(draft) + 1):
        token = pick(j)
        picks.append(token)
        if j == len(draft) or token != draft[j] or is_eog(token):
            break
    return picks


class DraftPlanner:
    """The speculation a backend's steps ask for (engine/llama/types.py ``StepPlanner``):
    each step's drafts by the one policy, the accept rule, and the cost of a forward pass by
    rows as this machine measures it (``step_cost``, the plan's prices). ``n_ubatch``: the
    rows of one forward pass; ``split``: the KV cache is split per slot (a pass per run of
    consecutive slots)."""

    def __init__(self, n_ubatch: int, *, split: bool, step_cost: StepCost | None = None) -> None:
        self.step_cost = step_cost if step_cost is not None else StepCost()
        self._cost = BatchCost(self.step_cost, n_ubatch, split=split)

    def drafts(
        self, slots: Sequence[int], streams: Sequence[tuple[Speculation | None, Sequence[int], int, int]], room: int
    ) -> list[list[int]]:
        return step_drafts(slots, streams, self._cost, room)

    def measured(self, slots: Sequence[int], rows: Sequence[int], seconds: float) -> None:
        """A step's decode time, counted into the cost of a pass of its rows if it was one
        forward pass (``rows``: each slot's positions in the batch)."""
        passes = self._cost.passes(batch_counts(slots, rows))
        if len(passes) == 1:
            self.step_cost.add(passes[0], seconds)

    def measured_singles(self, first: int, last: int, n: int, seconds: float) -> None:
        """``measured`` for a step of ``n`` slots, one position each, ``first`` to ``last``
        (ascending), in constant time: it was one pass if its ``n`` rows fit a ubatch and,
        under a split cache, its slots are consecutive (a gap starts a pass of its own)."""
        if self._cost.one_pass_of_singles(first, last, n):
            self.step_cost.add(n, seconds)

    verify = staticmethod(verify)
