"""Histories that start alike hold their first positions once in the prompt cache: a state
split at a position into its head (the first KV cache's cells below it) and the rest, joined
back into what a slot restores (engine/llama/statesplice.py ``split_head``/``join_head``,
``Snapshot.split``/``joined``, kv/promptcache.py's ``_Head``). Synthetic states check the byte
surgery cell by cell; a real backend checks llama.cpp restores a joined state, and that the
head of one history continues another's."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import http, scrape
from hydra_trio.engine import SamplingParams
from hydra_trio.engine.kv import PromptCache
from hydra_trio.engine.llama import LlamaBackend, Snapshot
from hydra_trio.engine.llama.seqstate import (
    STATE_MAGIC,
    MemoryShape,
    RecurrentShape,
    StateLayoutError,
    read_layout,
)
from hydra_trio.engine.llama.statesplice import join_head, split_head, window_at, window_gap
from hydra_trio.engine.sample import Sampler

# A cache: (n_layer, K/V row bytes (element bytes x elements for a transposed V)).
Cache = tuple[int, int]


def _cell_bytes(cache: int, layer: int, kv: int, pos: int, n: int) -> bytes:
    """Bytes that name the cell they belong to, so a misplaced row shows."""
    return bytes((cache * 31 + layer * 7 + kv * 3 + pos + i) % 251 for i in range(n))


def _section(cache: int, positions: list[int], n_layer: int, row: int, v_trans: bool) -> bytes:
    """One stream's cells in the order ``positions`` lists them, as llama.cpp writes them."""
    cells = len(positions)
    out = [struct.pack("<I", cells), b"".join(struct.pack("<iIi", p, 1, 0) for p in positions)]
    out.append(struct.pack("<II", int(v_trans), n_layer))
    for layer in range(n_layer):
        out += [struct.pack("<iQ", 1, row), *(_cell_bytes(cache, layer, 0, p, row) for p in positions)]
    for layer in range(n_layer):
        if v_trans:  # element j of every cell, then element j + 1
            el, n_embd = 2, row // 2
            out.append(struct.pack("<iII", 1, el, n_embd))
            rows = [_cell_bytes(cache, layer, 1, p, row) for p in positions]
            out += [r[j * el : (j + 1) * el] for j in range(n_embd) for r in rows]
        else:
            out += [struct.pack("<iQ", 1, row), *(_cell_bytes(cache, layer, 1, p, row) for p in positions)]
    return b"".join(out)


def _state(
    caches: list[tuple[list[int], Cache]], v_trans: bool, n_stream: int = 1, stream: int = 0, first: int = 0
) -> bytes:
    """A state of these caches (``first``: the first one's number, which its rows' bytes name:
    a checkpoint holds the second cache of a state)."""
    out = [struct.pack("<Ii", STATE_MAGIC, 0)]
    for i, (positions, (n_layer, row)) in enumerate(caches, start=first):
        out.append(struct.pack("<I", n_stream))
        empty = struct.pack("<I", 0)
        sec = _section(i, positions, n_layer, row, v_trans) if positions else empty
        out += [empty] * stream + [sec] + [empty] * (n_stream - 1 - stream)
    return b"".join(out)


cases = st.tuples(
    st.integers(2, 12),  # positions held
    st.lists(st.tuples(st.integers(1, 3), st.sampled_from([2, 4, 8])), min_size=1, max_size=2),
    st.booleans(),  # V transposed
    st.integers(1, 4),  # streams
    st.data(),
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(cases)
def test_a_split_state_joins_back_cell_for_cell(case: tuple) -> None:
    """Every cell of the first cache goes to the head (below the split) or the rest, with its
    rows; joined, the state holds the same cells (the head's first), and the other caches and
    what follows (logits) as they were, in the one-stream form."""
    n_past, layers, v_trans, n_stream, data = case
    order = data.draw(st.permutations(range(n_past)))  # cells in any order (a reused cache)
    window = list(order[-data.draw(st.integers(0, n_past)) :]) if len(layers) > 1 else []
    n = data.draw(st.integers(1, n_past - 1))
    stream = data.draw(st.integers(0, n_stream - 1))
    caches = [(list(order), layers[0]), *((window, c) for c in layers[1:])]
    shape = MemoryShape(len(caches))
    tail = data.draw(st.binary(max_size=8))
    state = _state(caches, v_trans, n_stream, stream) + tail
    parts = split_head(state, n, shape)
    assert parts is not None
    head, rest, end = parts
    assert state[end:] == tail
    assert read_layout(head, shape).n_past == n and read_layout(rest, shape).n_past == n_past - n
    joined = b"".join(bytes(p) for p in join_head(head, rest + tail, shape))
    first = [p for p in order if p < n] + [p for p in order if p >= n]
    assert joined == _state([(first, layers[0]), *caches[1:]], v_trans) + tail


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(st.integers(6, 40), st.integers(1, 3), st.booleans(), st.integers(1, 3), st.data())
def test_a_window_checkpoint_is_held_as_what_the_state_lacks(
    n_past: int, n_layer: int, v_trans: bool, n_stream: int, data: st.DataObject
) -> None:
    """An iSWA checkpoint (the window cache's cells at fewer positions) kept as the cells the
    state's window lacks, and made again from them and the state: the same cells, with their
    rows, in position order."""
    window = data.draw(st.integers(2, n_past - 1))
    cut = data.draw(st.integers(window, n_past - 1))  # the checkpoint's positions
    layers = (n_layer, 4)
    state = _state([(list(range(n_past)), (1, 4)), (list(range(n_past - window, n_past)), layers)], v_trans, n_stream)
    cells = list(range(cut - window, cut))
    stream = data.draw(st.integers(0, n_stream - 1))
    checkpoint = _state([(cells, layers)], v_trans, n_stream, stream, first=1)  # the window cache's rows
    gap = window_gap(checkpoint, state, MemoryShape(2))
    lacking = [p for p in cells if p < n_past - window]
    if len(lacking) == len(cells):
        assert gap is None  # nothing in common: kept whole
        return
    assert gap is not None and gap[1] == cut - window
    assert read_layout(gap[0], MemoryShape(1)).caches[0].cells == len(lacking)
    assert window_at(gap[0], state, gap[1], cut, MemoryShape(2)) == _state([(cells, layers)], v_trans, first=1)
    # A checkpoint all inside the state's window (a history shorter than the window): an
    # empty gap, the checkpoint made from the state alone.
    short = _state([(list(range(n_past)), (1, 4)), (list(range(n_past)), layers)], v_trans)
    empty = window_gap(checkpoint, short, MemoryShape(2))
    assert empty is not None and read_layout(empty[0], MemoryShape(1)).caches[0].section is None
    assert window_at(empty[0], short, empty[1], cut, MemoryShape(2)) == _state([(cells, layers)], v_trans, first=1)
    with pytest.raises(StateLayoutError):  # a gap of another layout
        window_at(_state([(lacking or [0], (n_layer, 8))], v_trans, first=1), state, gap[1], cut, MemoryShape(2))


def test_what_does_not_split_is_named() -> None:
    shape = MemoryShape(1)
    whole = _state([(list(range(6)), (2, 4))], False)
    assert split_head(whole, 6, shape) is None  # nothing past the head
    assert split_head(_state([([0, 1, 3, 4], (2, 4))], False), 3, shape) is None  # position 2 missing
    assert split_head(_state([([0, 1, 1, 4], (2, 4))], False), 2, shape) is None  # position 1 twice
    assert split_head(b"junk", 2, shape) is None
    assert split_head(whole, 2, MemoryShape(1, RecurrentShape(1))) is None  # a recurrent state
    parts, other = split_head(whole, 2, shape), split_head(_state([(list(range(6)), (2, 8))], False), 2, shape)
    assert parts is not None and other is not None
    with pytest.raises(StateLayoutError):  # another row size: not parts of one state
        join_head(parts[0], other[1], shape)


def _snap(tokens: list[int], layers: Cache = (2, 4), logits: bytes = b"") -> Snapshot:
    room = 8
    state = _state([(list(range(len(tokens))), layers)], False)
    return Snapshot(tokens, bytearray(room) + state + logits, room, bool(logits), shape=MemoryShape(1))


def test_the_prompt_cache_holds_a_shared_head_once() -> None:
    """Two histories of one 300-token system prompt: the second put splits both, the bytes
    held fall by the head's, and each comes back whole (its logits too); the head goes with
    the last entry that uses it. An entry that extends one keeps using its head."""
    system = list(range(300))
    a, b = _snap([*system, 1, 2, 3], logits=b"LA"), _snap([*system, 4, 5], logits=b"LB")
    cache = PromptCache(1 << 30)
    assert cache.put(_snap(a.tokens, logits=b"LA"))
    assert cache.nbytes == a.nbytes and cache.shared == 0
    assert cache.put(_snap(b.tokens, logits=b"LB"))
    head = cache._head[1]
    assert cache._head[0] is head and head.n_tokens == 300 and head.users == 2
    assert cache.nbytes < a.nbytes + b.nbytes - head.nbytes // 2
    # A third history of the same prompt shares the head as it is; one extending b replaces b.
    c = _snap([*system, 9])
    assert cache.put(_snap(c.tokens))
    b2 = _snap([*b.tokens, 6, 7], logits=b"L2")
    assert cache.put(_snap(b2.tokens, logits=b"L2"))
    assert len(cache) == 3 and head.users == 3 and cache.shared == 4
    for snap in (a, c, b2):
        hit = cache.best(snap.tokens)
        assert hit is not None and hit.n_common == len(snap.tokens)
        back = cache.take(hit.key)
        assert back.tokens == snap.tokens and back.offset == snap.offset
        assert bytes(back.buf[back.offset :]) == bytes(snap.buf[snap.offset :])
    assert len(cache) == 0 and cache.nbytes == 0 and not cache._head


def test_room_is_made_by_entries_a_head_outlives_them() -> None:
    """Bytes bound what is held, heads included: evictions free an entry's own part, its head
    when no entry uses it any more; spilled entries leave whole."""
    system = list(range(300))
    spilled: list[Snapshot] = []
    one = _snap([*system, *range(150)]).nbytes
    cache = PromptCache(int(one * 1.5), spill=lambda snap, owner: spilled.append(snap))
    for k in range(6):
        assert cache.put(_snap([*system, 1000 + k, *range(150)]))
        assert cache.nbytes <= cache.max_bytes
    assert len(cache) == 2  # without the head, one entry at a time would fit
    assert spilled and all(bytes(s.buf[s.offset :]) == bytes(_snap(s.tokens).buf[8:]) for s in spilled)
    assert len({id(h) for h in cache._head.values()}) == 1
    cache.drop_owned({None})
    assert len(cache) == 0 and cache.nbytes == 0


def test_whole_states_stay_whole() -> None:
    """A snapshot that cannot split (no shape: a recurrent state, an unread layout), or
    shares fewer than MIN_SHARED positions, is kept as it was."""
    cache = PromptCache(1 << 30)
    system = list(range(300))
    plain = Snapshot([*system, 1], bytearray(_snap([*system, 1]).buf), 8, False)
    assert cache.put(plain) and cache.put(Snapshot([*system, 2], bytearray(plain.buf), 8, False))
    assert cache.put(_snap([*range(100), 7])) and cache.put(_snap([*range(100), 8]))
    assert not cache._head and cache.shared == 0


# ---- a real backend ---------------------------------------------------------------------


def _prefill(backend: LlamaBackend, slot: int, tokens: list[int]) -> None:
    for at in range(0, len(tokens) - backend.n_batch, backend.n_batch):  # in chunks of n_batch, as the engine
        backend.eval_chunk(slot, tokens[at : at + backend.n_batch], None)
    sampler = Sampler(SamplingParams())
    try:
        backend.eval_chunk(slot, tokens[backend.n_past(slot) :], None, sampler=sampler, want_logits=True)
    finally:
        sampler.close()


@pytest.fixture(params=["unified", "split"])
def backend(tiny_model_ctx: Path, request: pytest.FixtureRequest) -> Iterator[LlamaBackend]:
    unified = request.param == "unified"
    b = LlamaBackend(
        str(tiny_model_ctx), n_slots=3, n_ctx=1024 if unified else 3 * 1024, n_threads=1, n_batch=64, kv_unified=unified
    )
    yield b
    b.close()


def test_one_historys_head_continues_another(backend: LlamaBackend) -> None:
    """Two histories of one 128-token prompt: the second's rest joined to the first's head
    restores into a third slot as the second (its tokens and logits). In its own stream (a
    split cache) the prompt's KV is the same bits whoever computed it, so the slot holds the
    second's state byte for byte; in a unified cache a prefill beside another slot's cells
    rounds a few f16 values otherwise, and its own head joins back to it exactly."""
    system = [(7 * i) % 400 + 20 for i in range(128)]
    a, b = [*system, *range(30, 70)], [*system, *range(90, 150)]
    _prefill(backend, 0, a)
    _prefill(backend, 1, b)
    snap_a, snap_b = backend.snapshot(0), backend.snapshot(1)
    assert snap_a.shape is not None and snap_b.has_logits
    head_a, head_b, rest_b = snap_a.split(len(system)), snap_b.split(len(system)), snap_b.split(len(system))
    assert head_a is not None and head_b is not None and rest_b is not None

    def restored(snap: Snapshot) -> bytes:
        view = memoryview(snap.buf)
        assert backend.state_restore(2, view[snap.offset :], snap.tokens, len(snap.tokens), blob=view) is True
        assert backend.tail_logits[2] == backend.tail_logits[1] and backend.seq_tokens[2] == b
        return bytes(backend.state_get(2)[0])

    want = restored(snap_b)  # b's own snapshot, restored into the same slot
    assert restored(rest_b[1].joined(head_b[0])) == want
    shared = restored(rest_b[1].joined(head_a[0]))
    if not backend.kv_unified:
        assert shared == want


async def test_an_engine_serves_histories_of_one_prompt_from_a_shared_head(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """One slot, three histories of one 400-token prompt taking turns: the ones the slot
    drops share their head in RAM (the bytes say so), and each comes back whole: its next
    turn reuses as much and continues as the same turns do on an engine with a slot for each
    (the same batches: a split cache computes a prompt alike in any slot)."""
    system = [(7 * i) % 400 + 20 for i in range(400)]
    prompts = [[*system, *(((31 * k + i) % 200) + 30 for i in range(60))] for k in range(3)]

    async def turns(ep: Any, order: list[int]) -> dict[int, dict[str, Any]]:
        out = {}
        async with http(ep) as h:
            for k in order:
                r = await h.post("/v1/completions", json={"prompt": prompts[k], "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                out[k] = r.json()
            out[-1] = {"metrics": await scrape(h)}
        return out

    ep = await start_engine(tiny_model_ctx, slots=1, cache_ram_mib=64)
    got = await turns(ep, [0, 1, 2, 0])
    m = got[-1]["metrics"]
    assert m[("hydra_prompt_cache_shared_bytes", ())] > 0
    assert got[0]["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompts[0]) - 1  # back from RAM, whole
    # Each history its own slot (a prompt sharing 87 % with another's slot would take it).
    kept_ep = await start_engine(
        tiny_model_ctx, slots=3, ctx_size=3 * 2048, cache_ram_mib=0, slot_prompt_similarity=0.99
    )
    kept = await turns(kept_ep, [0, 1, 2, 0])
    assert got[0]["usage"] == kept[0]["usage"]
    assert got[0]["choices"][0]["text"] == kept[0]["choices"][0]["text"]
