"""KV states between layouts (engine/llama/seqstate.py): the one-stream form blobs travel in, a
split cache's per-slot streams, and the layout check a restore makes before it touches a
slot. Synthetic states check the byte surgery; real backends check llama.cpp agrees."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hydra_trio.engine.llama.context import LlamaBackend
from hydra_trio.engine.llama.seqstate import (
    STATE_MAGIC,
    StateLayoutError,
    layout_mismatch,
    read_layout,
    rewrite_in_place,
    with_streams,
)
from hydra_trio.engine.llama.types import StepRequest
from hydra_trio.engine.params import SamplingParams
from hydra_trio.engine.sample import Sampler
from hydra_trio.wire.errors import ErrorCode, ProtocolError

PROMPT = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"


def _section(cells: int, n_layer: int, row: int, fill: int, v_trans: bool) -> bytes:
    meta = b"".join(struct.pack("<iIi", pos, 1, 0) for pos in range(cells))
    out = [struct.pack("<I", cells), meta, struct.pack("<II", int(v_trans), n_layer)]
    for _ in range(n_layer):
        out += [struct.pack("<iQ", 1, row), bytes([fill]) * (cells * row)]
    for _ in range(n_layer):
        if v_trans:
            out += [struct.pack("<iII", 1, 2, row // 2), bytes([fill + 1]) * (cells * row)]
        else:
            out += [struct.pack("<iQ", 1, row), bytes([fill + 1]) * (cells * row)]
    return b"".join(out)


def _state(sections: list[bytes], n_stream: int, stream: int) -> bytes:
    out = [struct.pack("<Ii", STATE_MAGIC, 0)]
    for sec in sections:
        out.append(struct.pack("<I", n_stream))
        out += [struct.pack("<I", 0)] * stream + [sec] + [struct.pack("<I", 0)] * (n_stream - 1 - stream)
    return b"".join(out)


layouts = st.tuples(
    st.lists(st.tuples(st.integers(1, 5), st.integers(1, 3), st.sampled_from([2, 4, 8])), min_size=1, max_size=2),
    st.booleans(),
    st.integers(1, 6),
    st.data(),
)


@given(layouts)
def test_rewrites_between_stream_counts_keep_every_byte(case: tuple) -> None:
    caches, v_trans, n_stream, data = case
    stream = data.draw(st.integers(0, n_stream - 1))
    sections = [_section(c, n, r, 7 * i + 1, v_trans) for i, (c, n, r) in enumerate(caches)]
    tail = data.draw(st.binary(max_size=16))
    one = _state(sections, 1, 0) + tail
    local = _state(sections, n_stream, stream) + tail
    assert with_streams(one, n_stream, stream, len(caches)) == local
    assert with_streams(local, 1, 0, len(caches)) == one
    # In place: the free bytes before the state take what the rewrite adds.
    room = 4 * n_stream * len(caches)
    buf = bytearray(room) + one
    out = rewrite_in_place(memoryview(buf), room, n_stream, stream, len(caches))
    assert out is not None and bytes(out) == local
    buf = bytearray(local)
    out = rewrite_in_place(memoryview(buf), 0, 1, 0, len(caches))
    assert out is not None and bytes(out) == one
    # Already in the wanted form: the same object back, nothing copied.
    assert with_streams(one, 1, 0, len(caches)) is one
    layout = read_layout(local, len(caches))
    assert layout.n_past == caches[0][0] and layout.end == len(local) - len(tail)


def test_in_place_needs_room_before_the_state() -> None:
    one = _state([_section(2, 1, 4, 1, False)], 1, 0)
    assert rewrite_in_place(memoryview(bytearray(one)), 0, 4, 2, 1) is None


def test_malformed_states_are_refused_by_the_parser() -> None:
    good = _state([_section(2, 2, 4, 1, False)], 1, 0)
    for bad in (b"", good[:6], b"\x00" * 4 + good[4:], good[:-1], _state([_section(2, 2, 4, 1, False)] * 2, 3, 1)[:-3]):
        with pytest.raises(StateLayoutError):
            read_layout(bad, None)
    two_streams = struct.pack("<IiI", STATE_MAGIC, 0, 2) + _section(1, 1, 4, 1, False) * 2
    with pytest.raises(StateLayoutError, match="more than one non-empty stream"):
        read_layout(two_streams, None)


def test_layout_mismatch_names_the_difference() -> None:
    local = read_layout(_state([_section(2, 2, 4, 1, False)], 1, 0), None)
    assert layout_mismatch(local, local) is None
    assert "transposed" in str(layout_mismatch(read_layout(_state([_section(2, 2, 4, 1, True)], 1, 0), None), local))
    assert "3 layers" in str(layout_mismatch(read_layout(_state([_section(2, 3, 4, 1, False)], 1, 0), None), local))
    assert "2 KV caches" in str(
        layout_mismatch(read_layout(_state([_section(2, 2, 4, 1, False)] * 2, 1, 0), None), local)
    )
    q8 = _state([_section(2, 2, 4, 1, False)], 1, 0).replace(struct.pack("<iQ", 1, 4), struct.pack("<iQ", 8, 4), 1)
    assert "q8_0/f16, here f16/f16" in str(layout_mismatch(read_layout(q8, None), local))


# ---- real backends -------------------------------------------------------------------------


def _backend(model: Path, *, n_slots: int, kv_unified: bool, type_k: int | None = None) -> LlamaBackend:
    n_ctx = 512 if kv_unified else 512 * n_slots
    return LlamaBackend(
        str(model), n_slots=n_slots, n_ctx=n_ctx, n_threads=1, n_batch=64, kv_unified=kv_unified, type_k=type_k
    )


def _greedy(b: LlamaBackend, slot: int, first: int, n: int = 16) -> list[int]:
    sampler = Sampler(SamplingParams())
    try:
        out = [first]
        for _ in range(n - 1):
            res = b.step([StepRequest(slot, out[-1], sampler)])[0]
            assert res is not None
            out += res
        return out
    finally:
        sampler.close()


@pytest.fixture
def backends(tiny_model_ctx: Path) -> Iterator[dict[str, LlamaBackend]]:
    made = {
        "unified-2": _backend(tiny_model_ctx, n_slots=2, kv_unified=True),
        "split-2": _backend(tiny_model_ctx, n_slots=2, kv_unified=False),
        "split-3": _backend(tiny_model_ctx, n_slots=3, kv_unified=False),
    }
    yield made
    for b in made.values():
        b.close()


@pytest.mark.parametrize(("src", "dst"), [("split-3", "unified-2"), ("unified-2", "split-3"), ("split-2", "split-3")])
def test_a_blob_moves_between_layouts_and_slot_counts(backends: dict[str, LlamaBackend], src: str, dst: str) -> None:
    """A slot's state from one layout restores into another (another stream count, another
    slot) and continues with the same tokens as the engine that made it."""
    a, b = backends[src], backends[dst]
    prompt = a.tokenize(PROMPT, add_special=True)
    sampler = Sampler(SamplingParams())
    first, logits = a.eval_chunk(1, prompt, None, sampler=sampler, want_logits=True)
    sampler.close()
    assert first is not None and logits is not None
    state, tokens = a.state_get(1)
    assert len(state) == a.state_size(1) == a.slot_state_size(1)
    assert read_layout(state, None).caches[0].n_stream == 1  # the one-stream form travels
    want = _greedy(a, 1, first)
    restored = bytearray(state) + logits
    assert b.state_restore(b.n_slots - 1, memoryview(restored), tokens, len(tokens)) is True
    slot = b.n_slots - 1
    # Read back: the same cells and rows in the one-stream form (the sequence ids in it name
    # the new slot).
    again = [c for c in read_layout(b.state_get(slot)[0], None).caches]
    sent = [c for c in read_layout(state, None).caches]
    assert [(c.n_stream, c.cells, c.rows) for c in again] == [(c.n_stream, c.cells, c.rows) for c in sent]
    tail = b.tail_logits[slot]
    assert tail == logits
    s2 = Sampler(SamplingParams())
    try:
        got_first = b.sample_from_logits(s2, tail)
    finally:
        s2.close()
    assert _greedy(b, slot, got_first) == want


def test_a_state_with_another_k_type_is_refused_before_the_slot_is_touched(tiny_model_ctx: Path) -> None:
    f32 = _backend(tiny_model_ctx, n_slots=2, kv_unified=False, type_k=0)  # GGML_TYPE_F32 (quantized types need a wider head than the tiny model's)
    f16 = _backend(tiny_model_ctx, n_slots=2, kv_unified=False)
    try:
        prompt = f32.tokenize(PROMPT, add_special=True)
        f32.eval_chunk(0, prompt, None)
        state, tokens = f32.state_get(0)
        f16.eval_chunk(1, prompt[:5], None)
        with pytest.raises(ProtocolError) as exc:
            f16.state_restore(1, memoryview(state), tokens, len(tokens))
        assert exc.value.code == ErrorCode.CAP_MISMATCH  # made elsewhere, not damaged
        assert "K/V cache types f32/f16, here f16/f16" in exc.value.message
        assert f16.seq_tokens[1] == prompt[:5]  # refused before the slot was touched
    finally:
        f32.close()
        f16.close()


def test_a_row_size_past_any_buffer_is_a_layout_error_not_a_crash() -> None:
    """Found by benchmarks/hostile.py: a STATE_PUT whose blob claims a row of 2^63 bytes
    made the offset overflow C's ssize_t (an internal error instead of RESTORE_FAILED)."""
    state = (
        struct.pack("<IiII", STATE_MAGIC, 0, 1, 1) + bytes(12)  # one stream, one cell
        + struct.pack("<II", 0, 1) + struct.pack("<iQ", 1, 2**63 - 1) + bytes(64)  # one layer, its K row
    )
    with pytest.raises(StateLayoutError):
        read_layout(state, 1)
