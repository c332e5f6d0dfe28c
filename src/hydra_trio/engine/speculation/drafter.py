"""n-gram drafting (prompt lookup, llama-server's ``--spec-type ngram-simple``): what one
request could draft next and how likely each position of it is accepted.

A request's next tokens often repeat text it has seen (code edits, quoting, summaries): the
tokens that followed an earlier occurrence of its last tokens are a cheap guess, in its own
tokens or, failing a long match there, in what earlier requests of its cache salt generated
(``NgramMemory``). ``Speculation`` is a request's drafting state, on the GPU worker with its
request; how much of each candidate a step takes is ``policy.py``'s decision. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """What one request speculates with (server flags, then its own ``speculative`` keys)."""

    n_max: int = 16  # drafted tokens per step at most
    n_min: int = 0  # a shorter draft is not proposed
    ngram_max: int = 12  # a match's context is compared over this many tokens at most
    ngram_min: int = 1  # a match covers at least this many tokens
    max_batch: int = 8  # no drafting in a step with more generating slots than this


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
        # An image's positions (negative ids, engine/llama/vision.py) are never a token to draft.
        if min(draft, default=0) < 0:
            draft = draft[: next(i for i, t in enumerate(draft) if t < 0)]
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
