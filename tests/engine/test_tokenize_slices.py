"""Prompt text tokenized in slices on the GPU worker (engine/slices.py, issue 50): llama.cpp's
special-token pass is quadratic in their number, so long text goes a slice at a time, each
cut before a special token and checked. Any text tokenizes to exactly the tokens of one whole
call, cut or not; and the work of the slices is linear where the whole call's is not."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydra_trio.engine import slices
from hydra_trio.engine.llama import LlamaBackend
from hydra_trio.engine.worker import GpuWorker

pytestmark = pytest.mark.slow  # loads a model

PIECES = [
    "<|im_start|>",
    "<|im_end|>",
    "user",
    "assistant",
    "\n",
    " ",
    "  ",
    "a",
    "word ",
    "é",
    "日本",
    "<|im_",
    "|>",
    "<",
    ">",
    "<|endoftext|>",
    "\t",
    "0123",
]


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> Iterator[LlamaBackend]:
    b = LlamaBackend(str(tiny_model), n_slots=1, n_ctx=256, n_threads=1, n_batch=64)
    yield b
    b.close()


def sliced(backend: LlamaBackend, text: str, add_special: bool) -> list[int]:
    async def run() -> list[int]:
        return await slices.tokenize_sliced(GpuWorker(), backend, text, add_special=add_special)

    return trio.run(run)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.sampled_from(PIECES), min_size=1, max_size=400), add_special=st.booleans())
def test_any_text_tokenizes_the_same_in_slices(
    backend: LlamaBackend, parts: list[str], add_special: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slices, "SLICE_CHARS", 40)  # cuts every few dozen characters
    monkeypatch.setattr(slices, "SEARCH_CHARS", 160)
    text = "".join(parts)
    assert sliced(backend, text, add_special) == backend.tokenize(text, add_special=add_special)


def test_slices_of_many_special_tokens_cost_linear_work(backend: LlamaBackend) -> None:
    """A generous bound (CPU time of four times the text, at most 8x: linear is 4x, one
    quadratic call 16x); one whole call is shown to be quadratic beside it."""
    unit = "<|im_start|>user\na<|im_end|>\n"

    def cpu(fn: object, text: str) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.thread_time()
            fn(text)  # type: ignore[operator]
            best = min(best, time.thread_time() - t0)
        return best

    small, large = unit * 2000, unit * 8000
    whole = [cpu(lambda t: backend.tokenize(t, add_special=True), x) for x in (small, large)]
    cut = [cpu(lambda t: sliced(backend, t, True), x) for x in (small, large)]
    assert sliced(backend, large, True) == backend.tokenize(large, add_special=True)
    assert cut[1] <= 8 * cut[0] + 0.02, cut
    assert whole[1] > 8 * whole[0], whole  # what the slices avoid (if llama.cpp's pass were linear, they could go)
