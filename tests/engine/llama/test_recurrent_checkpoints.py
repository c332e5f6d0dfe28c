"""Context checkpoints of a recurrent model (the synthetic mamba GGUF): its state is one per
sequence, at its last position, so no cut keeps it; a checkpoint (the recurrent state at
fewer positions) is what a prompt that diverges inside the slot's history resumes from. A KV
blob's checkpoint section is kept as one, and the engine's own prefill takes them, as
llama-server does for recurrent and hybrid models."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from helpers import http
from hydra_trio.engine.llama import LlamaBackend
from hydra_trio.wire import Checkpoint, encode_kv_blob, parse_kv_blob

OCTETS = {"content-type": "application/octet-stream"}
PROMPT = "the river runs past the old mill and the owls watch it from the trees " * 3
OTHER = "but the bread is baked at dawn in the village and the children eat it"
PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


@pytest.fixture
def backend(mamba_model: Path) -> Iterator[LlamaBackend]:
    b = LlamaBackend(str(mamba_model), n_slots=1, n_ctx=512, n_threads=1, n_batch=256)
    yield b
    b.close()


def _partial_state(b: LlamaBackend, slot: int) -> bytes:
    """The slot's recurrent state as the fork captures a checkpoint's."""
    size = int(llama_cpp.llama_state_seq_get_size_ext(b._ctx, slot, PARTIAL))
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data_ext(b._ctx, buf, size, slot, PARTIAL) == size
    return bytes(buf)


def test_the_synthetic_mamba_model_is_recurrent(backend: LlamaBackend) -> None:
    assert backend.info.recurrent and not backend.info.hybrid and not backend.info.can_roll_back
    backend.eval_chunk(0, backend.tokenize(PROMPT, add_special=True), None)
    # One state per sequence: its size does not grow with the positions, and the partial
    # state (a checkpoint's) is all of it.
    assert backend.state_size(0) == backend.slot_state_size(0) == backend.state_size_for(1)
    assert len(_partial_state(backend, 0)) == backend.checkpoint_size


def test_a_cut_resumes_from_a_checkpoint_there_and_nowhere_else(backend: LlamaBackend) -> None:
    tokens = backend.tokenize(PROMPT, add_special=True)
    k = len(tokens) - 10
    backend.eval_chunk(0, tokens[:k], None)
    backend.take_checkpoint(0)
    backend.eval_chunk(0, tokens[k:], None)
    assert backend.reusable_prefix(0, len(tokens)) == len(tokens)
    assert backend.reusable_prefix(0, len(tokens) - 1) == k  # the checkpoint, not the cut
    assert backend.reusable_prefix(0, k - 1) == 0
    # A saved state alone: only all of it continues, or all but its last position when the
    # request's prompt is the whole of it; with its checkpoint (the prompt cache's entries
    # carry the slot's latest: Snapshot.checkpoint), a cut at or past it resumes there.
    assert [backend.reusable_in_state(100, n) for n in (100, 99, 98, 50)] == [100, 99, 0, 0]
    assert [backend.reusable_in_state(100, n, 60) for n in (100, 98, 60, 50)] == [100, 60, 60, 0]
    snap = backend.snapshot(0)
    assert snap.checkpoint is not None and snap.checkpoint.n_tokens == k
    assert snap.nbytes == len(snap.buf) + len(snap.checkpoint.data)
    assert backend.truncate_slot(0, k) == k
    mem = llama_cpp.llama_get_memory(backend._ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == k - 1  # the checkpoint's state
    backend.eval_chunk(0, tokens[k:], None)
    # No checkpoint at the cut: the state cannot be kept, the slot is emptied.
    assert backend.truncate_slot(0, k + 3) == 0
    assert backend.seq_tokens[0] == [] and llama_cpp.llama_memory_seq_pos_max(mem, 0) == -1


def _fork_blob(b: LlamaBackend, tokens: list[int], k: int, *, taken_at: int | None = None) -> bytes:
    """A v2 blob as the fork writes one on a recurrent model: the state at all ``tokens``,
    and a checkpoint section holding the recurrent state at the first ``k`` (``taken_at``:
    a damaged one, the state at another count that says ``k``)."""
    at = k if taken_at is None else taken_at
    b.clear_slot(0)
    b.eval_chunk(0, tokens[:at], None)
    data = _partial_state(b, 0)
    b.eval_chunk(0, tokens[at:], None)
    state, _ = b.state_get(0)
    ck = Checkpoint(k - 1, k - 1, k, memoryview(data), memoryview(b""))
    return encode_kv_blob(len(tokens), tokens, state, checkpoint=ck)


def _top5(body: dict[str, Any]) -> dict[str, float]:
    top: dict[str, float] = body["choices"][0]["logprobs"]["top_logprobs"][0]
    return top


async def _matches_a_cold_recompute(h: Any, body: dict[str, Any], resumed: dict[str, Any]) -> dict[str, Any]:
    """Empty the slot and compute ``body`` again from nothing: the resumed reply's next-token
    top 5 are the cold one's. Returns the cold reply."""
    assert (await h.post("/slots/0?action=erase")).status_code == 200
    r = await h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    cold: dict[str, Any] = r.json()
    a, b = _top5(resumed), _top5(cold)
    assert sorted(a) == sorted(b)
    for token, logprob in a.items():
        assert logprob == pytest.approx(b[token], abs=1e-3)
    return cold


async def test_a_restored_checkpoint_is_where_a_diverging_prompt_resumes(
    start_engine: Callable[..., Any], mamba_model: Path, backend: LlamaBackend
) -> None:
    """The restored blob holds PROMPT; its checkpoint is 10 tokens before the end. A prompt
    sharing PROMPT up to 3 tokens before the end, then another text, evaluates only what
    follows the checkpoint, and its next token's top 5 are those of a cold computation."""
    tokens = backend.tokenize(PROMPT, add_special=True)
    k = len(tokens) - 10
    blob = _fork_blob(backend, tokens, k)
    diverging = tokens[:-3] + backend.tokenize(" " + OTHER, add_special=False)
    ep = await start_engine(mamba_model, slots=1, cache_ram_mib=0)
    body = {"prompt": diverging, "max_tokens": 1, "temperature": 0, "logprobs": 5}
    async with http(ep) as h:
        r = await h.put("/slots/0/state", content=blob, headers=OCTETS)
        assert r.status_code == 200, r.text
        r = await h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        resumed = r.json()
        assert resumed["timings"]["prompt_n"] == len(diverging) - k
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == k
        cold = await _matches_a_cold_recompute(h, body, resumed)
        assert cold["timings"]["prompt_n"] == len(diverging)


async def test_the_engine_s_own_prefill_leaves_a_checkpoint_to_resume_from(
    start_engine: Callable[..., Any], mamba_model: Path, backend: LlamaBackend
) -> None:
    """A prompt's prefill stops 4 tokens before its end for a checkpoint (llama-server's
    offsets); the next prompt, sharing all but the last 2 tokens of the first one's prompt
    (not its reply), resumes there."""
    tokens = backend.tokenize(PROMPT, add_special=True)
    then = tokens[:-2] + backend.tokenize(" " + OTHER, add_special=False)
    ep = await start_engine(mamba_model, slots=1, cache_ram_mib=0)
    body = {"max_tokens": 1, "temperature": 0, "logprobs": 5}
    async with http(ep) as h:
        r = await h.post("/v1/completions", json={**body, "prompt": tokens, "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["timings"]["prompt_n"] == len(tokens)  # and the slot went 8 past it
        r = await h.post("/v1/completions", json={**body, "prompt": then})
        assert r.status_code == 200, r.text
        resumed = r.json()
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tokens) - 4
        assert resumed["timings"]["prompt_n"] == len(then) - (len(tokens) - 4)
        await _matches_a_cold_recompute(h, {**body, "prompt": then}, resumed)


async def test_a_checkpoint_of_another_size_or_outside_the_blob_is_refused(
    start_engine: Callable[..., Any], mamba_model: Path, backend: LlamaBackend
) -> None:
    tokens = backend.tokenize(PROMPT, add_special=True)
    good = _fork_blob(backend, tokens, len(tokens) - 10)
    state, _ = backend.state_get(0)
    short = Checkpoint(5, 5, 6, memoryview(b"\x00" * 64), memoryview(b""))
    outside = Checkpoint(0, len(tokens), 6, memoryview(_partial_state(backend, 0)), memoryview(b""))
    ep = await start_engine(mamba_model, slots=1, cache_ram_mib=0)
    async with http(ep) as h:
        assert (await h.put("/slots/0/state", content=good, headers=OCTETS)).status_code == 200
        for ck, said in ((short, "of 64 bytes; the resident model's recurrent state is"), (outside, "outside the")):
            r = await h.put(
                "/slots/0/state", content=encode_kv_blob(len(tokens), tokens, state, checkpoint=ck), headers=OCTETS
            )
            assert r.status_code == 400 and said in r.text, r.text
        assert (await h.get("/slots/0/state/meta")).json()["n_past"] == len(tokens)
        # What this engine writes has no checkpoint section: its state is whole at n_past.
        got = parse_kv_blob((await h.get("/slots/0/state")).content)
        assert got.checkpoint is None and got.tokens == tokens


async def test_a_checkpoint_whose_state_lies_about_its_position_is_not_resumed_from(
    start_engine: Callable[..., Any], mamba_model: Path, backend: LlamaBackend
) -> None:
    """The section says 10 tokens before the end, but its recurrent state is the one 15
    before (its own position says so): the resume is refused where the state is put back,
    the slot is emptied and the prompt computed whole, as a cold one."""
    tokens = backend.tokenize(PROMPT, add_special=True)
    k = len(tokens) - 10
    blob = _fork_blob(backend, tokens, k, taken_at=k - 5)
    diverging = tokens[:-3] + backend.tokenize(" " + OTHER, add_special=False)
    ep = await start_engine(mamba_model, slots=1, cache_ram_mib=0)
    async with http(ep) as h:
        assert (await h.put("/slots/0/state", content=blob, headers=OCTETS)).status_code == 200
        r = await h.post("/v1/completions", json={"prompt": diverging, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["timings"]["prompt_n"] == len(diverging)


async def test_a_history_back_from_ram_resumes_at_its_checkpoint(
    start_engine: Callable[..., Any], mamba_model: Path, backend: LlamaBackend
) -> None:
    """One slot: PROMPT's history (its prefill left a checkpoint 4 tokens before the end)
    goes to the prompt cache when another prompt takes the slot. A prompt that shares PROMPT
    but its last 2 tokens brings it back and resumes at that checkpoint, as it would have in
    the slot (its entry carries the checkpoint), not from nothing; the next token's top 5 are
    those of a cold computation."""
    tokens = backend.tokenize(PROMPT, add_special=True)
    then = tokens[:-2] + backend.tokenize(" " + OTHER, add_special=False)
    ep = await start_engine(mamba_model, slots=1, cache_ram_mib=64)
    body = {"max_tokens": 1, "temperature": 0, "logprobs": 5}
    async with http(ep) as h:
        for prompt in (tokens, backend.tokenize(OTHER * 3, add_special=True)):
            r = await h.post("/v1/completions", json={**body, "prompt": prompt, "max_tokens": 8})
            assert r.status_code == 200, r.text
        r = await h.post("/v1/completions", json={**body, "prompt": then})
        assert r.status_code == 200, r.text
        resumed = r.json()
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tokens) - 4
        assert resumed["timings"]["prompt_n"] == len(then) - (len(tokens) - 4)
        await _matches_a_cold_recompute(h, {**body, "prompt": then}, resumed)
