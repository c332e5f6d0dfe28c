"""KV states between layouts (engine/llama/seqstate.py): the one-stream form blobs travel in, a
split cache's per-slot streams, and the layout check a restore makes before it touches a
slot (engine/llama/statematch.py). Synthetic states check the byte surgery; real backends
check llama.cpp agrees."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hydra_trio.engine import SamplingParams
from hydra_trio.engine.llama import LlamaBackend, StepRequest
from hydra_trio.engine.llama.seqstate import (
    STATE_MAGIC,
    MemoryShape,
    RecurrentShape,
    StateLayoutError,
    learn_shape,
    read_layout,
    rewrite_in_place,
    with_streams,
)
from hydra_trio.engine.llama.statematch import layout_mismatch
from hydra_trio.engine.sample import Sampler
from hydra_trio.wire import ErrorCode, ProtocolError

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


def _state(sections: list[bytes], n_stream: int, stream: int, recurrent: bytes = b"") -> bytes:
    out = [struct.pack("<Ii", STATE_MAGIC, 0)]
    for sec in sections:
        out.append(struct.pack("<I", n_stream))
        out += [struct.pack("<I", 0)] * stream + [sec] + [struct.pack("<I", 0)] * (n_stream - 1 - stream)
    return b"".join(out) + recurrent  # a recurrent section has no stream count


def _recurrent(pos: int | None, n_layer: int, n_rows: int, r_row: int, s_row: int, ple: int = 0) -> bytes:
    """A recurrent section as llama_memory_recurrent::state_write writes one sequence's: its
    one cell (at ``pos``; None: empty), then R rows (each with a PLE conv row when ``ple``)
    and S rows of the ``n_rows`` layers that have them."""
    cells = 0 if pos is None else 1
    out = [struct.pack("<I", cells), struct.pack("<iI", pos, 0) if cells else b"", struct.pack("<II", 0, n_layer)]
    for i in range(n_rows):
        out += [struct.pack("<iQ", 0, r_row), bytes([i + 1]) * (cells * r_row)]
        if ple:
            out += [struct.pack("<Q", ple), bytes([0x70 + i]) * (cells * ple)]
    for i in range(n_rows):
        out += [struct.pack("<iQ", 0, s_row), bytes([0x40 + i]) * (cells * s_row)]
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
    assert with_streams(one, n_stream, stream, MemoryShape(len(caches))) == local
    assert with_streams(local, 1, 0, MemoryShape(len(caches))) == one
    # In place: the free bytes before the state take what the rewrite adds.
    room = 4 * n_stream * len(caches)
    buf = bytearray(room) + one
    out = rewrite_in_place(memoryview(buf), room, n_stream, stream, MemoryShape(len(caches)))
    assert out is not None and bytes(out) == local
    buf = bytearray(local)
    out = rewrite_in_place(memoryview(buf), 0, 1, 0, MemoryShape(len(caches)))
    assert out is not None and bytes(out) == one
    # Already in the wanted form: the same object back, nothing copied.
    assert with_streams(one, 1, 0, MemoryShape(len(caches))) is one
    layout = read_layout(local, MemoryShape(len(caches)))
    assert layout.n_past == caches[0][0] and layout.end == len(local) - len(tail)


recurrent_layouts = st.tuples(
    st.integers(0, 2),  # KV caches before it (0: a recurrent model; 1, 2: hybrid, hybrid iSWA)
    st.integers(1, 4),  # n_layer
    st.data(),
)


@given(recurrent_layouts)
def test_a_recurrent_section_travels_as_it_is_between_stream_counts(case: tuple) -> None:
    """Only the KV caches' stream counts change; the recurrent section (no stream count, one
    pool of states whatever the layout) and the logits after it are copied as they are, and
    the shape read off a state is the one it was written with."""
    n_kv, n_layer, data = case
    n_rows = n_layer if n_kv == 0 else data.draw(st.integers(1, n_layer))
    ple = data.draw(st.sampled_from([0, 8]))
    pos = data.draw(st.integers(0, 50))
    r_row, s_row = data.draw(st.sampled_from([4, 12])), data.draw(st.sampled_from([8, 16]))
    rec = _recurrent(pos, n_layer, n_rows, r_row, s_row, ple)
    sections = [_section(pos + 1, 2, 4, 9 * i + 1, False) for i in range(n_kv)]
    n_stream = data.draw(st.integers(1, 5))
    stream = data.draw(st.integers(0, n_stream - 1))
    one, local = _state(sections, 1, 0, rec), _state(sections, n_stream, stream, rec)
    shape = learn_shape(one, n_kv=n_kv, recurrent=True)
    assert shape == MemoryShape(n_kv, RecurrentShape(n_rows, bool(ple)))
    tail = data.draw(st.binary(max_size=16))
    assert with_streams(one + tail, n_stream, stream, shape) == local + tail
    assert with_streams(local + tail, 1, 0, shape) == one + tail
    room = 4 * n_stream * n_kv
    out = rewrite_in_place(memoryview(bytearray(room) + one + tail), room, n_stream, stream, shape)
    assert out is not None and bytes(out) == local + tail
    layout = read_layout(local + tail, shape)
    assert layout.n_past == pos + 1 and layout.end == len(local) and layout.n_kv == n_kv
    assert layout.caches[-1].recurrent and bytes((local + tail)[slice(*layout.caches[-1].section)]) == rec


def test_a_recurrent_state_of_another_shape_is_named() -> None:
    shape = MemoryShape(0, RecurrentShape(2))
    local = read_layout(_state([], 1, 0, _recurrent(3, 2, 2, 12, 16)), shape)
    assert layout_mismatch(local, local) is None
    wider = read_layout(_state([], 1, 0, _recurrent(3, 2, 2, 12, 32)), shape)
    assert "recurrent row 0: R/S row sizes (12, 0)/(32,), here (12, 0)/(16,)" in str(layout_mismatch(wider, local))
    deeper = read_layout(_state([], 1, 0, _recurrent(3, 3, 2, 12, 16)), shape)
    assert "recurrent state of 3 layers, the resident model has 2" in str(layout_mismatch(deeper, local))
    empty = read_layout(_state([], 1, 0, _recurrent(None, 2, 2, 12, 16)), shape)
    assert empty.n_past == 0 and layout_mismatch(empty, local) is None
    # A KV cache where the resident model keeps a recurrent state, and the reverse.
    kv = read_layout(_state([_section(2, 2, 4, 1, False)], 1, 0))
    assert "recurrent state where" in str(layout_mismatch(kv, local))
    # A cell naming sequences is a whole-memory state, not one sequence's.
    many = _state([], 1, 0, _recurrent(3, 2, 2, 12, 16)).replace(struct.pack("<iI", 3, 0), struct.pack("<iI", 3, 1))
    with pytest.raises(StateLayoutError, match="not one sequence"):
        read_layout(many, shape)
    with pytest.raises(StateLayoutError):  # cut short
        read_layout(_state([], 1, 0, _recurrent(3, 2, 2, 12, 16))[:-1], shape)


def test_in_place_needs_room_before_the_state() -> None:
    one = _state([_section(2, 1, 4, 1, False)], 1, 0)
    assert rewrite_in_place(memoryview(bytearray(one)), 0, 4, 2, MemoryShape(1)) is None


def test_malformed_states_are_refused_by_the_parser() -> None:
    good = _state([_section(2, 2, 4, 1, False)], 1, 0)
    for bad in (b"", good[:6], b"\x00" * 4 + good[4:], good[:-1], _state([_section(2, 2, 4, 1, False)] * 2, 3, 1)[:-3]):
        with pytest.raises(StateLayoutError):
            read_layout(bad)
    two_streams = struct.pack("<IiI", STATE_MAGIC, 0, 2) + _section(1, 1, 4, 1, False) * 2
    with pytest.raises(StateLayoutError, match="more than one non-empty stream"):
        read_layout(two_streams)


def test_layout_mismatch_names_the_difference() -> None:
    local = read_layout(_state([_section(2, 2, 4, 1, False)], 1, 0))
    assert layout_mismatch(local, local) is None
    assert "transposed" in str(layout_mismatch(read_layout(_state([_section(2, 2, 4, 1, True)], 1, 0)), local))
    assert "3 layers" in str(layout_mismatch(read_layout(_state([_section(2, 3, 4, 1, False)], 1, 0)), local))
    assert "2 KV caches" in str(
        layout_mismatch(read_layout(_state([_section(2, 2, 4, 1, False)] * 2, 1, 0)), local)
    )
    q8 = _state([_section(2, 2, 4, 1, False)], 1, 0).replace(struct.pack("<iQ", 1, 4), struct.pack("<iQ", 8, 4), 1)
    assert "q8_0/f16, here f16/f16" in str(layout_mismatch(read_layout(q8), local))


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
    assert read_layout(state).caches[0].n_stream == 1  # the one-stream form travels
    want = _greedy(a, 1, first)
    restored = bytearray(state) + logits
    assert b.state_restore(b.n_slots - 1, memoryview(restored), tokens, len(tokens)) is True
    slot = b.n_slots - 1
    # Read back: the same cells and rows in the one-stream form (the sequence ids in it name
    # the new slot).
    again = [c for c in read_layout(b.state_get(slot)[0]).caches]
    sent = [c for c in read_layout(state).caches]
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
    # GGML_TYPE_F32 (quantized types need a wider head than the tiny model's)
    f32 = _backend(tiny_model_ctx, n_slots=2, kv_unified=False, type_k=0)
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
        read_layout(state, MemoryShape(1))


@pytest.mark.parametrize("model", ["mamba_model", "hybrid_model"])
@pytest.mark.parametrize("kv_unified", [False, True], ids=["split", "unified"])
def test_a_recurrent_models_state_is_one_form_on_every_layout(
    request: pytest.FixtureRequest, model: str, kv_unified: bool
) -> None:
    """Three slots of the mamba model (a recurrent state only) and of the hybrid one (a KV
    cache, then a recurrent state): STATE_GET's copy is in the one-stream form, sized as
    STATE_META says, and a restore into another slot continues with the same tokens, which
    another history would not give."""
    b = _backend(request.getfixturevalue(model), n_slots=3, kv_unified=kv_unified)
    try:
        layout = b.state_layout
        assert layout is not None and layout.caches[-1].recurrent
        assert layout.n_kv == (1 if model == "hybrid_model" else 0)
        assert (b.cache_layout != {}) == (model == "hybrid_model")  # K/V types: the KV cache's
        prompt = b.tokenize(PROMPT, add_special=True)
        sampler = Sampler(SamplingParams())
        first, logits = b.eval_chunk(1, prompt, None, sampler=sampler, want_logits=True)
        sampler.close()
        assert first is not None and logits is not None
        state, tokens = b.state_get(1)
        assert len(state) == b.state_size(1) == b.slot_state_size(1)
        assert read_layout(state, b._shape).n_past == len(prompt)
        assert all(c.recurrent or c.n_stream == 1 for c in read_layout(state, b._shape).caches)
        want = _greedy(b, 1, first)
        assert b.state_restore(2, memoryview(bytearray(state) + logits), tokens, len(tokens)) is True
        assert _greedy(b, 2, first) == want
        # The continuation depends on the history: another prompt's state, then the same
        # first token, gives other tokens.
        b.eval_chunk(0, b.tokenize("the bread is baked at dawn in the village", add_special=True), None)
        assert _greedy(b, 0, first) != want
    finally:
        b.close()
