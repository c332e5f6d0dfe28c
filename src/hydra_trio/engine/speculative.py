"""n-gram speculative decoding (prompt lookup, llama-server's ``--spec-type ngram-simple``):
drafts from the request's own prompt and output, verified in the step batch.

A request's next tokens often repeat text it has seen (code edits, quoting, summaries): the
tokens that followed the most recent earlier occurrence of its last n tokens are a cheap
guess. The guess rides in the same llama_decode as every other slot's step, as extra
positions of its sequence with logits for each; the sampler picks at each position in turn
(``verify``), the longest matching prefix is kept plus the pick after it, and the rejected
positions are removed from the KV (engine/llama/context.py).

Pure Python, no llama call: ``Speculation`` lives on the GPU worker with its request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..wire.sampling import SPEC_TYPES

if TYPE_CHECKING:  # params.py imports this module, and it must not pull in config (gguf)
    from ..config import Settings

__all__ = [
    "SPEC_TYPES", "SpecConfig", "SpecCounts", "SpecRequest", "Speculation", "StepCost",
    "request_speculation", "spec_config", "verify",
]

# Every verified position costs about a token's compute (its logits: the output layer over
# the whole vocabulary), so a request drafts what its drafts earn: the next draft is at most
# 2m + 1 tokens after one that had m accepted (a full draft grows it, a miss shrinks it to
# one), and while its acceptance rate (accepted / drafted, a moving average over its
# drafts) is below MIN_ACCEPTANCE it drafts no more for BACKOFF_STEPS steps (doubled each
# time it is still low, at most BACKOFF_MAX), then tries again. Measured on a CPU (Gemma 3
# 270M, docs/performance.md): 75-87 % acceptance gained 1.5-1.8x, 41 % lost (0.8x alone,
# 0.45x at 8 streams).
MIN_ACCEPTANCE = 0.6
RATE_WEIGHT = 0.3  # the latest draft's weight in the moving average
BACKOFF_STEPS = 4
BACKOFF_MAX = 64


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """What one request speculates with (server flags, then its own ``speculative`` keys)."""

    n_max: int = 16  # drafted tokens per step at most
    n_min: int = 0  # a shorter draft is not proposed
    ngram_max: int = 3  # lookup n-gram sizes, tried from ngram_max down to ngram_min
    ngram_min: int = 1
    max_batch: int = 4  # no drafting in a step with more generating slots than this


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
    """The most recent end of every n-gram (n in [n_min, n_max]) of a growing token list,
    indexed incrementally: a step adds its few new tokens, not the whole history."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self._next_end = 0  # n-grams ending before this (exclusive end) are indexed

    def update(self, history: Sequence[int]) -> None:
        if len(history) + 1 < self._next_end:  # the history was cut: start over (not during a request)
            self._last.clear()
            self._next_end = 0
        last = self._last
        for end in range(max(self._next_end, self.n_min), len(history) + 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                last[tuple(history[end - n : end])] = end
        self._next_end = len(history) + 1

    def draft(self, history: Sequence[int], token: int, n_draft: int) -> list[int]:
        """Up to ``n_draft`` tokens that followed the most recent earlier occurrence of the
        last n tokens of ``history + [token]`` (the longest n that occurred), or none."""
        self.update(history)
        length = len(history) + 1
        for n in range(min(self.n_max, length), self.n_min - 1, -1):
            key = (*history[len(history) - (n - 1) :], token) if n > 1 else (token,)
            end = self._last.get(key)
            if end is None:
                continue
            # The continuation: history from ``end`` on, then ``token`` (the current one).
            out = list(history[end : end + n_draft])
            if len(out) < n_draft and end + len(out) == len(history):
                out.append(token)
            return out
        return []


class StepCost:
    """What a step's decode costs, measured per size: the mean llama_decode time of the
    engine's recent generation steps of each number of rows (rows: the positions with
    logits, the streams' tokens and their drafts). Not a line: on a CPU with repacked
    weights the matrix kernels take rows in blocks, so a step's cost follows the row count
    in steps (Gemma 3 270M, one thread, docs/performance.md: 2 rows cost 2.4x one row, and
    4 rows less than 3). So a draft's length is chosen against these figures
    (``shortest_paying``), and every size is measured where it runs: a size not seen lately is
    taken to cost what the largest seen below it costs (the optimistic guess, which its
    first run then corrects).

    Worker only (updated and read there); read at scrape time for /metrics (plain floats)."""

    WEIGHT = 0.2  # the latest decode's weight in its size's mean
    STALE_STEPS = 4096  # a size not measured for this many steps is measured anew

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}  # rows -> mean seconds (bounded by n_batch)
        self._seen: dict[int, int] = {}  # rows -> the step it was last measured at
        self.steps = 0

    def add(self, rows: int, seconds: float) -> None:
        self.steps += 1
        mean = self._mean.get(rows)
        self._mean[rows] = seconds if mean is None else mean + self.WEIGHT * (seconds - mean)
        self._seen[rows] = self.steps
        if self.steps % self.STALE_STEPS == 0:
            for r in [r for r, at in self._seen.items() if self.steps - at > self.STALE_STEPS]:
                del self._mean[r], self._seen[r]

    def measured(self) -> dict[int, float]:
        """rows -> mean seconds, of the sizes measured lately (a copy)."""
        return dict(self._mean)

    def estimate(self, rows: int) -> float | None:
        """A step of ``rows`` rows: its mean, else what the largest size below costs; None
        when nothing at or below it was measured."""
        mean = self._mean.get(rows)
        if mean is not None:
            return mean
        below = [r for r in self._mean if r < rows]
        return self._mean[max(below)] if below else None

    def shortest_paying(self, n: int, cap: int, rows: int) -> int:
        """The shortest draft length from ``n`` up to ``cap`` that, accepted whole, makes more
        tokens per second of a step that already holds ``rows`` rows (each counted a token:
        drafts before this one as if accepted whole) than no draft; 0 when none does. ``n``
        when the step's cost is unmeasured."""
        base = self.estimate(rows)
        if base is None:
            return n
        for k in range(n, cap + 1):
            cost = self.estimate(rows + k)
            assert cost is not None  # rows + k > rows, which has an estimate
            if cost <= 0 or (rows + k) / cost > rows / base:
                return k
        return 0


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

    def __init__(self, config: SpecConfig, totals: SpecCounts | None = None) -> None:
        self.config = config
        self.counts = SpecCounts()
        self._totals = totals
        self._index = NgramIndex(config.ngram_min, config.ngram_max)
        self._rate = 1.0  # acceptance rate, moving average (optimistic at first)
        self._pause = 0  # steps left without drafting
        self._backoff = BACKOFF_STEPS
        self._cap = config.n_max  # the next draft's length at most
        self._probe = False  # the draft after a pause is a one-token probe

    def propose(
        self,
        history: Sequence[int],
        token: int,
        room: int,
        n_generating: int,
        paying: Callable[[int, int], int] | None = None,
    ) -> list[int]:
        """The draft for the step that evaluates ``token`` after ``history`` (the slot's
        tokens): at most ``room`` tokens (what the request, the slot and the batch still
        take), none when the step has more than ``max_batch`` generating slots or this
        request backs off, at most 2m + 1 after a draft that had m accepted (one after a
        pause). ``paying(n, cap)``: the shortest length from n up to cap that can pay at the
        step's measured cost (StepCost.shortest_paying), 0 if none can: a draft too short to
        pay for its rows grows to one that can, or is not made."""
        cfg = self.config
        if n_generating > cfg.max_batch:
            return []
        if self._pause > 0:
            self._pause -= 1
            return []
        least = max(1, cfg.n_min)
        probe, self._probe = self._probe, False
        n = min(1 if probe else self._cap, room)
        if paying is not None and n >= least:
            n = paying(n, min(cfg.n_max, room))
        if n < least:
            return []
        draft = self._index.draft(history, token, n)
        if paying is not None and draft and paying(len(draft), len(draft)) == 0:
            return []  # the lookup found less, too little to pay
        return draft if len(draft) >= least else []

    def record(self, n_drafted: int, n_accepted: int) -> None:
        """A verified draft: its counts, the next draft's length, and the back-off when
        drafts keep missing (the one draft policy, with ``propose``)."""
        self.counts.add(n_drafted, n_accepted)
        self._cap = min(self.config.n_max, max(2 * n_accepted + 1, self.config.n_min))
        if self._totals is not None:
            self._totals.add(n_drafted, n_accepted)
        if n_drafted:
            self._rate += RATE_WEIGHT * (n_accepted / n_drafted - self._rate)
        if self._rate >= MIN_ACCEPTANCE:
            self._backoff = BACKOFF_STEPS
            return
        self._pause = self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self._probe = True


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
    settings: Settings, request: SpecRequest | None, can_roll_back: bool, totals: SpecCounts
) -> Speculation | None:
    """A request's drafting under the server's ``--spec-*`` settings (``spec_config``), or
    None; its verified drafts also count into ``totals`` (the engine's)."""
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
    return None if config is None else Speculation(config, totals)
