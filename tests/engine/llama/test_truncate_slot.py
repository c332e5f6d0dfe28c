"""A slot cut back to a shared prefix, and one whose memory cannot be cut back.

llama.cpp keeps one state per sequence for a recurrent model (the synthetic mamba GGUF), not
one cell per position: no cut keeps it. Without a context checkpoint at the cut (here they
are off; tests/engine/llama/test_recurrent_checkpoints.py has them) the slot is emptied and the prompt
recomputed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from helpers import http
from hydra_trio.engine import SamplingParams
from hydra_trio.engine.llama import LlamaBackend
from hydra_trio.engine.sample import Sampler

PROMPT = "the river runs past the old mill and the owls watch it from the trees " * 4


@pytest.fixture
def backend(tiny_model_ctx: Path) -> Iterator[LlamaBackend]:
    b = LlamaBackend(str(tiny_model_ctx), n_slots=1, n_ctx=512, n_threads=1, n_batch=256, kv_unified=True)
    yield b
    b.close()


@pytest.fixture
def recurrent(mamba_model: Path) -> Iterator[LlamaBackend]:
    b = LlamaBackend(str(mamba_model), n_slots=1, n_ctx=512, n_threads=1, n_batch=256, ctx_checkpoints=0)
    yield b
    b.close()


def _fill(b: LlamaBackend) -> list[int]:
    prompt = b.tokenize(PROMPT, add_special=True)
    sampler = Sampler(SamplingParams())
    try:
        b.eval_chunk(0, prompt, None, sampler=sampler)
    finally:
        sampler.close()
    return prompt


def test_a_cut_keeps_the_prefix_it_reports(backend: LlamaBackend) -> None:
    prompt = _fill(backend)
    assert backend.truncate_slot(0, len(prompt) - 5) == len(prompt) - 5
    assert backend.seq_tokens[0] == prompt[:-5]
    assert backend.truncate_slot(0, len(prompt)) == len(prompt) - 5  # nothing past the end to drop


def test_a_recurrent_state_cut_back_empties_the_slot_and_reports_nothing_kept(recurrent: LlamaBackend) -> None:
    prompt = _fill(recurrent)
    assert not recurrent.info.can_roll_back
    assert recurrent.truncate_slot(0, len(prompt) - 5) == 0
    assert recurrent.seq_tokens[0] == []
    mem = llama_cpp.llama_get_memory(recurrent._ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == -1  # the KV agrees: nothing held


async def test_a_prompt_recomputes_when_its_slot_cannot_be_cut(
    start_engine: Callable[..., Any], mamba_model: Path
) -> None:
    """One slot holds PROMPT + an answer; a prompt sharing only part of it needs a cut the
    recurrent state cannot take. It is computed whole (0 cached tokens) and answers as from
    an empty slot, instead of continuing a state that still holds the old tail."""
    ep = await start_engine(mamba_model, slots=1, ctx_size=1024, cache_ram_mib=0, ctx_checkpoints=0)
    other = PROMPT[: len(PROMPT) // 2] + "but the bread is baked at dawn in the village"
    body = {"max_tokens": 8, "temperature": 0}
    async with http(ep) as h:
        r = await h.post("/v1/completions", json={**body, "prompt": PROMPT})
        assert r.status_code == 200, r.text
        r = await h.post("/v1/completions", json={**body, "prompt": other})
        assert r.status_code == 200, r.text
        cut = r.json()
        assert cut["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # From an empty slot: a prompt sharing nothing clears it whole (no partial cut).
        r = await h.post("/v1/completions", json={**body, "prompt": "winter " * 8})
        assert r.status_code == 200, r.text
        r = await h.post("/v1/completions", json={**body, "prompt": other})
        assert r.status_code == 200, r.text
    assert cut["choices"][0]["text"] == r.json()["choices"][0]["text"]
