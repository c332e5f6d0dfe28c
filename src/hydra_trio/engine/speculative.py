"""n-gram speculative decoding (prompt lookup, llama-server's ``--spec-type ngram-simple``):
drafts from the request's own prompt and output, verified in the step batch.

A request's next tokens often repeat text it has seen (code edits, quoting, summaries): the
tokens that followed an earlier occurrence of its last tokens are a cheap guess, in its own
tokens or, failing a long match there, in what earlier requests of its cache salt generated
(``NgramMemory``). The guess rides in the same llama_decode as every other slot's step, as
extra positions of its sequence with logits for each; the sampler picks at each position in
turn (``verify``), the longest matching prefix is kept plus the pick after it, and the
rejected positions are removed from the KV (engine/llama/steps.py).

How long a draft is, is one decision for the whole step (``step_drafts``, ``plan_drafts``): each request
offers the continuation of its best match (``Speculation.candidate``) with the chance that
each further position is accepted, and the step takes the draft positions that make the
most tokens per second at the cost measured on this machine (engine/stepcost.py: the
forward passes the batch becomes, and what a pass of so many rows costs). So drafts grow
where they are accepted and rows are cheap, and stop where the batch is already large.

Pure Python, no llama call: ``Speculation`` lives on the GPU worker with its request.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..wire.sampling import SPEC_TYPES
from .stepcost import BatchCost, batch_counts

if TYPE_CHECKING:  # params.py imports this module, and it must not pull in config (gguf)
    from ..config import Settings

__all__ = [
    "SPEC_TYPES", "NgramIndex", "NgramMemories", "NgramMemory", "SpecConfig", "SpecCounts", "SpecRequest", "Speculation",
    "plan_drafts", "request_speculation", "spec_config", "step_drafts", "verify",
]

# The chance that a draft position is accepted, given the one before it was, is learned per
# request and per length of the match the draft came from (a continuation after 8 matching
# tokens of context is likelier right than one after a single token): counts of positions
# tried and the first failures, older drafts weighing less (EVIDENCE_DECAY per later draft
# of the same kind), starting from PRIOR_SURVIVAL counted as PRIOR_WEIGHT positions. A
# failed position ends a draft, so a draft of k with m accepted tried m + 1 positions (m if
# all were accepted) and failed once (or never): the estimate of a geometric run length from
# censored runs, not accepted / drafted, which a long draft accepted halfway would rate at
# 0.5. Chosen in a replay of greedy and sampled Gemma 3 270M replies against the step cost
# measured by rows (docs/performance.md).
MATCH_BUCKETS = (2, 4, 8)  # a match of 1, 2-3, 4-7, 8 or more tokens of context
# ... and, last, a continuation from the salt's memory of earlier requests (NgramMemory).
PRIOR_SURVIVAL = (0.4, 0.6, 0.8, 0.95, 0.9)
MEMORY_KIND = len(MATCH_BUCKETS) + 1
PRIOR_WEIGHT = 2.0
EVIDENCE_DECAY = 0.85
# A draft position this unlikely to be accepted is not worth pricing: at the cheapest a
# verified position costs about a quarter of a one-token step on a CPU (docs/performance.md).
LEAST_WORTH = 0.1


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """What one request speculates with (server flags, then its own ``speculative`` keys)."""

    n_max: int = 16  # drafted tokens per step at most
    n_min: int = 0  # a shorter draft is not proposed
    ngram_max: int = 12  # a match's context is compared over this many tokens at most
    ngram_min: int = 1  # a match covers at least this many tokens
    max_batch: int = 8  # no drafting in a step with more generating slots than this


@dataclass(frozen=True, slots=True)
class SpecRequest:
    """A request's ``speculative`` keys (None: the server's setting)."""

    type: str | None = None
    n_max: int | None = None
    n_min: int | None = None


def spec_config(
    *,
    server_type: str,
    n_max: int,
    n_min: int,
    ngram_max: int,
    ngram_min: int,
    max_batch: int,
    request: SpecRequest | None,
    can_roll_back: bool,
) -> SpecConfig | None:
    """The one rule of whether and how a request speculates: the request's keys beat the
    server's; a model whose KV cannot drop positions (recurrent, hybrid) never does (the
    server refuses --spec-type at start; a request asking is served without)."""
    req = request or SpecRequest()
    kind = req.type if req.type is not None else server_type
    if kind == "none" or not can_roll_back:
        return None
    n_max = req.n_max if req.n_max is not None else n_max
    n_min = req.n_min if req.n_min is not None else n_min
    if n_max < 1:
        return None
    return SpecConfig(n_max=n_max, n_min=min(n_min, n_max), ngram_max=ngram_max, ngram_min=ngram_min, max_batch=max_batch)


class NgramIndex:
    """Where each n-gram (n = ``n_min``) of a growing token list ended lately, indexed
    incrementally (a step adds its few new tokens, not the whole history); a lookup takes,
    of the latest occurrences of the last n tokens, the one whose context matches furthest
    back (up to ``n_max`` tokens; the latest of equals)."""

    KEEP = 16  # occurrences remembered per n-gram

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = max(n_min, n_max)
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ends (exclusive) of its latest occurrences
        self._next_end = 0  # n-grams ending before this (exclusive end) are indexed

    def update(self, history: Sequence[int]) -> None:
        if len(history) + 1 < self._next_end:  # the history was cut: start over (not during a request)
            self._ends.clear()
            self._next_end = 0
        n = self.n_min
        ends = self._ends
        for end in range(max(self._next_end, n), len(history) + 1):
            seen = ends.setdefault(tuple(history[end - n : end]), [])
            seen.append(end)
            if len(seen) > self.KEEP:
                del seen[0]
        self._next_end = len(history) + 1

    def draft(self, history: Sequence[int], token: int, n_draft: int) -> tuple[list[int], int]:
        """Up to ``n_draft`` tokens that followed the best earlier occurrence of the last
        tokens of ``history + [token]``, and how many tokens of context matched there (0:
        none occurred)."""
        self.update(history)
        n = self.n_min
        if len(history) + 1 < n:
            return [], 0
        key = (*history[len(history) - (n - 1) :], token) if n > 1 else (token,)
        best, best_len = -1, 0
        last = len(history)  # ``token`` is position ``last`` of the sequence
        for end in reversed(self._ends.get(key, ())):
            length = n  # the key itself; then further back, token by token
            while length < self.n_max and end - 1 - length >= 0 and history[end - 1 - length] == history[last - length]:
                length += 1
            if length > best_len:
                best, best_len = end, length
                if length == self.n_max:
                    break
        if best < 0:
            return [], 0
        # The continuation: history from ``best`` on, then ``token`` (the current one), then,
        # as the match runs into the present, what it drafted so far (a cycle goes round).
        out = list(history[best : best + n_draft])
        if len(out) < n_draft:
            out.append(token)
            period = len(out)
            while len(out) < n_draft:
                out.append(out[len(out) - period])
        return out, best_len


class NgramMemory:
    """What followed each run of ``n`` tokens in the requests of one cache salt, kept across
    requests (llama-server's ngram-mod keeps one such table for all requests): a request
    whose own tokens match little may continue what an earlier one generated (a retried or
    repeated call, an agent's next pass over the same file). Keyed by the run's hash; a
    collision only makes a draft that verification rejects. Bounded: at ``MAX_ENTRIES`` it
    starts over. Written and read on the GPU worker only."""

    MAX_ENTRIES = 1 << 16  # about 6 MiB of dict entries

    def __init__(self, n: int) -> None:
        self.n = n
        self._next: dict[int, int] = {}  # hash of n tokens -> the token that followed them

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: Sequence[int], start: int) -> None:
        """Remember the runs of ``tokens`` that end at ``start`` or later, each with the token
        after it."""
        n = self.n
        table = self._next
        first = max(start, n)
        if len(table) + len(tokens) - first > self.MAX_ENTRIES:
            table.clear()
        for end in range(first, len(tokens)):
            table[hash(tuple(tokens[end - n : end]))] = tokens[end]

    def draft(self, tail: Sequence[int], n_draft: int) -> list[int]:
        """Up to ``n_draft`` tokens that followed ``tail`` (its last n tokens), one lookup
        per token, each on the run it ends."""
        n = self.n
        if len(tail) < n:
            return []
        window = list(tail[-n:])
        out: list[int] = []
        table = self._next
        while len(out) < n_draft:
            token = table.get(hash(tuple(window[len(window) - n :])))
            if token is None:
                break
            out.append(token)
            window.append(token)
        return out


class NgramMemories:
    """An ``NgramMemory`` per cache salt (tenants' drafts never come from each other's
    replies), at most ``MAX_SALTS``, the least recently used forgotten first. ``for_salt``
    runs on the trio thread; a memory it hands out is used on the worker only."""

    MAX_SALTS = 16

    def __init__(self, n: int) -> None:
        self.n = n
        self._by_salt: OrderedDict[str | None, NgramMemory] = OrderedDict()

    def for_salt(self, salt: str | None) -> NgramMemory:
        memory = self._by_salt.get(salt)
        if memory is None:
            memory = self._by_salt[salt] = NgramMemory(self.n)
            if len(self._by_salt) > self.MAX_SALTS:
                self._by_salt.popitem(last=False)
        self._by_salt.move_to_end(salt)
        return memory


@dataclass(slots=True)
class SpecCounts:
    """Speculation's counters (vLLM's ``vllm:spec_decode_*``): an engine's totals, or one
    request's. Written on the GPU worker, read at scrape time (ints: no torn reads)."""

    drafts: int = 0  # drafts proposed and verified
    draft_tokens: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted

    def add(self, n_drafted: int, n_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += n_drafted
        self.accepted += n_accepted


class Speculation:
    """One request's drafting state and counts (on the GPU worker); ``totals``: the
    engine's counters, which every verified draft also counts into."""

    def __init__(self, config: SpecConfig, totals: SpecCounts | None = None, memory: NgramMemory | None = None) -> None:
        self.config = config
        self.counts = SpecCounts()
        self._totals = totals
        self._index = NgramIndex(config.ngram_min, config.ngram_max)
        self._memory = memory
        self._remembered = 0  # the request's tokens before this are in the memory
        n = len(PRIOR_SURVIVAL)
        self._failed = [0.0] * n  # per match bucket: first failures seen (decayed)
        self._tried = [0.0] * n  # per match bucket: positions tried (decayed)
        self._bucket = 0  # the bucket of the candidate last offered

    def candidate(self, history: Sequence[int], token: int, room: int) -> tuple[list[int], float]:
        """What this request could draft in the step that evaluates ``token`` after
        ``history`` (the slot's tokens): up to ``room`` tokens (what the request, the slot
        and the batch still take) and at most n_max, from its best n-gram match; and the
        chance that each of its positions is accepted given the one before was. ([], 0.0):
        nothing to draft."""
        n = min(self.config.n_max, room)
        if n < max(1, self.config.n_min):
            return [], 0.0
        draft, matched = self._index.draft(history, token, n)
        bucket = sum(matched >= b for b in MATCH_BUCKETS)
        memory = self._memory
        if memory is not None:
            if len(history) < self._remembered:  # the history was cut (not during a request)
                self._remembered = 0
            memory.add(history, self._remembered)
            self._remembered = len(history)
            if matched < memory.n:  # the memory's runs are n tokens of context: a longer match
                recalled = memory.draft([*history[len(history) - memory.n + 1 :], token], n)
                if recalled:
                    draft, bucket = recalled, MEMORY_KIND
        if not draft:
            return [], 0.0
        self._bucket = bucket
        return draft, 1.0 - (self._failed[bucket] + (1.0 - PRIOR_SURVIVAL[bucket]) * PRIOR_WEIGHT) / (
            self._tried[bucket] + PRIOR_WEIGHT
        )

    def record(self, n_drafted: int, n_accepted: int) -> None:
        """A verified draft (of the candidate last offered): its counts, and what it says of
        the chance that a position of such a match is accepted."""
        self.counts.add(n_drafted, n_accepted)
        if self._totals is not None:
            self._totals.add(n_drafted, n_accepted)
        failed = 1.0 if n_accepted < n_drafted else 0.0
        b = self._bucket
        self._failed[b] = self._failed[b] * EVIDENCE_DECAY + failed
        self._tried[b] = self._tried[b] * EVIDENCE_DECAY + n_accepted + failed


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


def request_speculation(
    settings: Settings, request: SpecRequest | None, can_roll_back: bool, totals: SpecCounts, memory: NgramMemory
) -> Speculation | None:
    """A request's drafting under the server's ``--spec-*`` settings (``spec_config``), or
    None; its verified drafts also count into ``totals`` (the engine's), and its tokens go
    into ``memory`` (its salt's) and are drafted from there too."""
    config = spec_config(
        server_type=settings.spec_type,
        n_max=settings.spec_draft_n_max,
        n_min=settings.spec_draft_n_min,
        ngram_max=settings.spec_ngram_size_n,
        ngram_min=settings.spec_ngram_min_n,
        max_batch=settings.spec_max_batch,
        request=request,
        can_roll_back=can_roll_back,
    )
    return None if config is None else Speculation(config, totals, memory)
