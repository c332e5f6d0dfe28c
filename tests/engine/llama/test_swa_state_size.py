"""A sliding-window model's exact state size, computed without a llama call (STATE_META,
/slots, a copy's reservation) from the slot's positions and its SWA cache's lowest one: it
must be the size llama.cpp writes, at every length, past the window, after steps, roll-backs,
a cut to a context checkpoint, a restore and a clear, in a unified and in a split cache.

Gemma 3 270M (window 512): its SWA cache (window + one ubatch a sequence) wraps while the
test runs, so cells below the window are overwritten at some steps and not yet at others.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hydra_trio.engine.llama import LlamaBackend
from hydra_trio.engine.llama.types import StepRequest
from hydra_trio.engine.sample import Sampler, SamplingParams

pytestmark = pytest.mark.realmodel

TEXT = "The history of the city of Paris is long and old, and its river runs past the mill. " * 80


@pytest.fixture(params=[1, 2], ids=["unified", "split"])
def backend(request: pytest.FixtureRequest, gemma_model: Path) -> Iterator[LlamaBackend]:
    slots = request.param
    b = LlamaBackend(str(gemma_model), n_slots=slots, n_ctx=1536 * slots, n_threads=1, n_batch=256,
                     kv_unified=slots == 1)
    yield b
    b.close()


def assert_size(b: LlamaBackend, slot: int) -> None:
    real = b.state_size(slot)
    assert b.slot_state_size(slot) == real == len(b.state_get(slot)[0]), (slot, b.n_past(slot))


def _steps(b: LlamaBackend, slots: list[int], tokens: dict[int, int], n: int, sampler: Sampler) -> None:
    for _ in range(n):
        res = b.step([StepRequest(s, tokens[s], sampler, n) for s in slots])
        for s, r in zip(slots, res, strict=True):
            assert r is not None
            tokens[s] = r[-1]
            assert_size(b, s)


def test_the_computed_size_is_llamas(backend: LlamaBackend) -> None:
    b = backend
    assert b.n_swa == 512 and b._swa_per_cell > 0  # the computed path, not the llama call
    prompt = b.tokenize(TEXT, add_special=True)[:1100]
    sampler = Sampler(SamplingParams(ignore_eos=True))
    try:
        assert_size(b, 0)
        tokens: dict[int, int] = {}
        for at in range(0, len(prompt), 200):
            tok, _ = b.eval_chunk(0, prompt[at : at + 200], None, sampler=sampler)
            assert tok is not None
            tokens[0] = tok
            assert_size(b, 0)
            if at == 800:
                b.take_checkpoint(0)  # at 1000 positions
        slots = [0]
        if b.n_slots > 1:  # a second stream beside it, shorter than the window
            tokens[1], _ = b.eval_chunk(1, prompt[:100], None, sampler=sampler)  # type: ignore[assignment]
            slots.append(1)
        _steps(b, slots, tokens, 40, sampler)
        held = b.n_past(0)
        assert b.truncate_slot(0, held - 1) == held - 1  # one back: the window still holds
        assert_size(b, 0)
        assert b.truncate_slot(0, 1000) == 1000  # the window is gone there: the checkpoint's
        assert_size(b, 0)
        tokens[0] = prompt[1000]
        _steps(b, slots, tokens, 20, sampler)
        state, held_tokens = b.state_get(0)
        target = b.n_slots - 1
        b.clear_slot(target)
        assert_size(b, target)
        b.state_restore(target, memoryview(state), held_tokens, len(held_tokens))
        assert_size(b, target)
        # A restored state holds its last window alone: one position back, one cell fewer
        # than the window in the SWA cache (a prompt that re-evaluates its last token).
        n = len(held_tokens)
        assert b.truncate_slot(target, n - 1) == n - 1
        assert_size(b, target)
        _steps(b, [target], {target: prompt[0]}, 5, sampler)
        assert b.truncate_slot(target, 300) in (0, 300)  # no checkpoint there: may empty it
        assert_size(b, target)
        b.clear_slot(0)
        assert_size(b, 0)
        for n in (1, 2, 511, 512, 513):  # around the window, from empty
            b.clear_slot(0)
            for at in range(0, n, 256):
                b.eval_chunk(0, prompt[at : min(n, at + 256)], None)
            assert_size(b, 0)
    finally:
        sampler.close()
