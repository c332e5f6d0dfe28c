"""The plain greedy pick taken for a whole step at once (engine/llama/steps.py
``_plain_argmax``, issue 53): one ``argmax(axis=1)`` over each run of adjacent plain rows
picks what each row's own argmax picks (ties to the first of equal maxima), and the rows of
requests that ask for more (log-probabilities, a chain, a draft) go the sampler's own way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hydra_trio.engine.llama.context import LlamaBackend
from hydra_trio.engine.llama.steps import BatchSteps
from hydra_trio.engine.llama.types import StepRequest
from hydra_trio.engine.sample import Sampler, SamplingParams

PROMPTS = ["the sea and the sky", "a stream of words", "hello world model", "days paper hard near"]


def _rows(n: int, n_vocab: int = 64, seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, n_vocab)).astype(np.float32)
    rows[1, [5, 40]] = rows[1].max() + 1.0  # a tie: the first of equal maxima is the pick
    rows[2, :] = 0.0  # all equal: token 0
    rows[3, [63, 2]] = [9.0, 9.0]  # a tie whose later id comes first in no order but the row's
    return rows


def test_plain_argmax_picks_each_plain_row_s_own_argmax_and_leaves_the_others() -> None:
    """Steps in batch order: plain, plain, a logprobs one, plain, a draft of two (three
    rows), plain, plain under ignore_eos (still plain: its ban is applied after the pick)."""
    plain = Sampler(SamplingParams())
    banned = Sampler(SamplingParams(ignore_eos=True))
    with_logprobs = Sampler(SamplingParams(), logprobs=2)
    seeded = Sampler(SamplingParams(temperature=0.8, seed=1))
    assert plain.plain and banned.plain and not with_logprobs.plain and not seeded.plain
    assert not Sampler(SamplingParams(), fast_path=False).plain  # the path before: every row its own way
    samplers = [plain, plain, with_logprobs, plain, plain, seeded, banned]
    drafts: list[list[int]] = [[], [], [], [], [7, 8], [], []]
    requests = [StepRequest(slot, 1, s) for slot, s in enumerate(samplers)]
    n_rows = sum(1 + len(d) for d in drafts)
    rows = _rows(n_rows)
    best = BatchSteps._plain_argmax(requests, range(len(requests)), drafts, rows)
    per_row = [int(r.argmax()) for r in rows]
    # Rows: 0 1 | 2 (logprobs) | 3 | 4 5 6 (the draft's) | 7 (seeded) | 8 (banned, plain)
    assert best == [per_row[0], per_row[1], None, per_row[3], None, None, None, None, per_row[8]]
    assert best[1] == 5 and per_row[1] == 5  # the tie's first
    assert best[3] == 2  # the tie's first by id, whatever the order the values were written in


def test_plain_argmax_of_a_step_of_plain_rows_only() -> None:
    rows = _rows(6)
    requests = [StepRequest(slot, 1, Sampler(SamplingParams())) for slot in range(6)]
    best = BatchSteps._plain_argmax(requests, range(6), [[] for _ in range(6)], rows)
    assert best == [int(r.argmax()) for r in rows]
    assert best[2] == 0


def test_take_argmax_applies_the_end_of_generation_ban() -> None:
    """The batched argmax hands the sampler the row's argmax: an end-of-generation token under
    a ban is replaced by the best other (in the row itself), and every pick is counted."""
    eog = np.array([3, 9], dtype=np.intp)
    row = np.arange(16, dtype=np.float32)
    row[9] = 100.0
    row[4] = 50.0
    banned = Sampler(SamplingParams(min_tokens=1))
    free = Sampler(SamplingParams())
    assert free.take_argmax(9, row.copy(), eog) == 9
    edited = row.copy()
    assert banned.take_argmax(9, edited, eog) == 4
    assert edited[9] == -np.inf  # the ban went into the row
    assert banned.take_argmax(4, row.copy(), eog) == 4  # min_tokens met: no ban
    assert banned.n_picked == 2 and free.n_picked == 1


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> Iterator[LlamaBackend]:
    b = LlamaBackend(str(tiny_model), n_slots=4, n_ctx=1024, n_threads=1, n_batch=64)
    yield b
    b.close()


def test_a_mixed_step_picks_what_each_row_s_own_sampler_picks(
    backend: LlamaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four streams in one step: plain, plain under ignore_eos, greedy with log-probabilities,
    plain. Each step's tokens are what a sampler of the path before picks from the same row
    (read again after the step); the plain rows never go through ``Sampler.sample``, the
    log-probabilities row does (and records them)."""
    params = [SamplingParams(), SamplingParams(ignore_eos=True), SamplingParams(), SamplingParams()]
    samplers = [
        Sampler(p, logprobs=3 if slot == 2 else None) for slot, p in enumerate(params)
    ]
    references = [Sampler(p, fast_path=False) for p in params]
    sampled: list[int] = []
    original = Sampler.sample

    def counted(self: Sampler, *args: object, **kwargs: object) -> int:
        sampled.append(samplers.index(self) if self in samplers else -1)
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    try:
        tokens = []
        for slot, text in enumerate(PROMPTS):
            backend.clear_slot(slot)
            tok, _ = backend.eval_chunk(slot, backend.tokenize(text, add_special=True), None, sampler=samplers[slot])
            assert tok is not None
            tokens.append(tok)
        monkeypatch.setattr(Sampler, "sample", counted)
        seen: set[int] = set()
        for _ in range(12):
            res = backend.step([StepRequest(s, tokens[s], samplers[s], 100) for s in range(4)])
            for s in range(4):
                assert res[s] is not None
                (tok,) = res[s]  # type: ignore[misc]
                assert backend._sample(references[s], s) == tok, f"stream {s} parted"
                tokens[s] = tok
                seen.add(tok)
        assert set(sampled) == {2, -1}, "a plain row went through Sampler.sample"
        assert sampled.count(2) == 12
        assert len(samplers[2].picked) == 12 + 1  # the prompt's pick, then one a step
        assert [s.n_picked for s in samplers] == [13, 13, 13, 13]
        assert len(seen) > 3, "the streams kept to a few tokens: a wrong pick could go unseen"
    finally:
        for s in samplers + references:
            s.close()
