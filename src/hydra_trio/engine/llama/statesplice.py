"""The prompt cache's storage splices of llama.cpp sequence states (kv/promptcache.py): a
history's first positions held apart as a head other histories share (``split_head``,
``join_head``), and an iSWA window checkpoint held as the cells the state lacks of it
(``window_gap``, ``window_at``). Each part is a state in the one-stream form, cut from and
joined by seqstate.py's reading of the layout.

Kept apart from seqstate.py because it changes with how the prompt cache stores states, not
with llama.cpp's layout. Pure: no llama_cpp import; what does not parse exactly is not split.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

from .seqstate import (
    CELL_META,
    HEAD,
    ROW,
    U32,
    VTRANS,
    Bytes,
    CacheSection,
    MemoryShape,
    StateLayoutError,
    parse_sections,
)

# ---- a history's first positions held apart (the prompt cache's shared prefixes) ------------
#
# A sequence's KV is per cell: its position (the cell's metadata) and one row per layer, so
# the cells of the first KV cache (full attention: every position) split by position into a
# head and the rest, and two such parts of the same history join back into the state
# llama.cpp wrote (cells in another order: a restore places each by its own position). A
# head computed by one history serves every history that starts with the same tokens: the
# prompt cache keeps it once for all of them (kv/promptcache.py). The other caches (an iSWA
# model's window) stay whole with the rest. Parts are in the one-stream form.


def _stream_parts(view: memoryview, cache: CacheSection, keep: Sequence[tuple[int, int]]) -> tuple[int, list[Any]]:
    """The cells ``keep`` (runs of cell indices) of one KV stream section: (cells, pieces of
    its bytes after the cell count)."""
    assert cache.section is not None and cache.rows is not None
    n = cache.cells
    off = cache.section[0] + 4
    pieces: list[Any] = [view[off + CELL_META * a : off + CELL_META * b] for a, b in keep]
    off += CELL_META * n
    pieces.append(view[off : off + 8])  # v_trans, n_layer
    off += 8
    v_trans, k_rows, v_rows = cache.rows
    for _, row in k_rows:
        pieces.append(view[off : off + ROW.size])
        off += ROW.size
        pieces += [view[off + row * a : off + row * b] for a, b in keep]
        off += n * row
    for v in v_rows:
        if v_trans:
            _, el, n_embd = v
            pieces.append(view[off : off + VTRANS.size])
            off += VTRANS.size
            for j in range(n_embd):
                base = off + j * n * el
                pieces += [view[base + el * a : base + el * b] for a, b in keep]
            off += n_embd * n * el
        else:
            row = v[1]
            pieces.append(view[off : off + ROW.size])
            off += ROW.size
            pieces += [view[off + row * a : off + row * b] for a, b in keep]
            off += n * row
    return sum(b - a for a, b in keep), pieces


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start = None
    for i, f in enumerate(flags):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(flags)))
    return out


def _kv_only(view: memoryview, shape: MemoryShape) -> list[CacheSection] | None:
    """The caches of a KV-only state whose first cache holds every position once (else None:
    a recurrent state, or a first cache that is a window)."""
    if shape.recurrent is not None:
        return None
    caches, _ = parse_sections(view, shape)
    first = caches[0] if caches else None
    if first is None or first.section is None or first.recurrent:
        return None
    return caches


def _positions(view: memoryview, cache: CacheSection) -> list[int]:
    assert cache.section is not None
    off = cache.section[0] + 4
    return [struct.unpack_from("<i", view, off + CELL_META * i)[0] for i in range(cache.cells)]


def split_head(state: Bytes, n: int, shape: MemoryShape) -> tuple[bytes, bytes, int] | None:
    """A state of ``n_past`` positions as (its head: the first KV cache's cells at positions
    below ``n``, the other caches empty; the rest: the state without them; where the rest ends
    in ``state``, what follows it there being a blob's logits), each in the one-stream form.
    None when it cannot split so (not KV only, the first cache not holding positions 0..n-1
    once each, or nothing past ``n``)."""
    view = memoryview(state).cast("B")
    try:
        caches = _kv_only(view, shape)
        if caches is None:
            return None
        end = parse_sections(view, shape)[1]
        pos = _positions(view, caches[0])
    except StateLayoutError:
        return None
    below = [p < n for p in pos]
    if sum(below) != n or len(set(p for p in pos if p < n)) != n or sum(below) == len(pos):
        return None
    head: list[Any] = [view[: HEAD.size]]
    rest: list[Any] = [view[: HEAD.size]]
    for i, cache in enumerate(caches):
        if i == 0:
            for part, keep in ((head, _runs(below)), (rest, _runs([not b for b in below]))):
                cells, pieces = _stream_parts(view, cache, keep)
                part += [U32.pack(1), U32.pack(cells), *pieces]
            continue
        head.append(U32.pack(1) + U32.pack(0))
        if cache.section is None:
            rest.append(U32.pack(1) + U32.pack(0))
        else:
            rest += [U32.pack(1), view[cache.section[0] : cache.section[1]]]
    return b"".join(head), b"".join(rest), end


def join_head(head: Bytes, rest: Bytes, shape: MemoryShape) -> list[Bytes]:
    """``split_head``'s two parts as one state again (its pieces, to copy once): the head's
    cells then the rest's in the first KV cache, the rest's other caches as they are. What
    follows ``rest``'s caches (a blob's logits) follows the joined state. Raises
    StateLayoutError when they are not two such parts of one model's state."""
    hv, rv = memoryview(head).cast("B"), memoryview(rest).cast("B")
    h_caches, _ = parse_sections(hv, shape)
    r_caches, r_end = parse_sections(rv, shape)
    if len(h_caches) != len(r_caches) or any(c.recurrent for c in r_caches):
        raise StateLayoutError("head and rest of different states")
    h0, r0 = h_caches[0], r_caches[0]
    if h0.section is None or h0.rows is None:
        raise StateLayoutError("an empty head")
    if r0.section is None:  # nothing of the first cache past the head
        first = [U32.pack(1), hv[h0.section[0] : h0.section[1]]]
    else:
        if r0.rows != h0.rows:
            raise StateLayoutError("head and rest of different KV layouts")
        _, h_pieces = _stream_parts(hv, h0, [(0, h0.cells)])
        _, r_pieces = _stream_parts(rv, r0, [(0, r0.cells)])
        first = [U32.pack(1), U32.pack(h0.cells + r0.cells), h_pieces[0], r_pieces[0], h_pieces[1]]
        hi, ri = 2, 2  # past the meta and (v_trans, n_layer): per layer a header then its rows
        v_trans, k_rows, v_rows = h0.rows
        for _ in k_rows:
            first += [h_pieces[hi], h_pieces[hi + 1], r_pieces[ri + 1]]
            hi, ri = hi + 2, ri + 2
        for v in v_rows:
            if v_trans:
                first.append(h_pieces[hi])
                for j in range(v[2]):
                    first += [h_pieces[hi + 1 + j], r_pieces[ri + 1 + j]]
                hi, ri = hi + 1 + v[2], ri + 1 + v[2]
            else:
                first += [h_pieces[hi], h_pieces[hi + 1], r_pieces[ri + 1]]
                hi, ri = hi + 2, ri + 2
    out: list[Bytes] = [rv[: HEAD.size], *first]
    for cache in r_caches[1:]:
        out.append(U32.pack(1) + U32.pack(0) if cache.section is None else U32.pack(1))
        if cache.section is not None:
            out.append(rv[cache.section[0] : cache.section[1]])
    out.append(rv[r_end:])
    return out


# ---- a window checkpoint held as what the state lacks of it ---------------------------------
#
# An iSWA model's context checkpoint (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: the window cache's
# cells at fewer positions) is mostly the state's own window again: a checkpoint 4 tokens
# before a prompt's end and the state after 16 generated tokens share all but 20 of their 512
# cells, and a cell's rows never change once computed. The prompt cache keeps only the cells
# the state lacks (``window_gap``) and makes the checkpoint again when it is restored
# (``window_at``): a 7.7 MB checkpoint of Gemma 3 270M held as 0.3 MB.

_ONE_CACHE = MemoryShape(1)


def _window_cells(view: memoryview, cache: CacheSection, keep: Callable[[int], bool]) -> tuple[int, list[Any]]:
    pos = _positions(view, cache)
    return _stream_parts(view, cache, _runs([keep(p) for p in pos]))


def window_gap(checkpoint: Bytes, state: Bytes, shape: MemoryShape) -> tuple[bytes, int] | None:
    """The checkpoint's cells at positions the state's window cache (its last KV cache) does
    not hold, as a one-cache state in the one-stream form, and the checkpoint's lowest
    position; None when the checkpoint is not that cache's (another layout, a recurrent
    state) or shares no cell with the state."""
    cv, sv = memoryview(checkpoint).cast("B"), memoryview(state).cast("B")
    try:
        caches = _kv_only(sv, shape)
        if caches is None or len(caches) < 2:
            return None
        window = caches[-1]
        (cp,), _ = parse_sections(cv, _ONE_CACHE)
        if cp.section is None or window.section is None or cp.rows != window.rows:
            return None
        held = set(_positions(sv, window))
        low = min(_positions(cv, cp))
        cells, pieces = _window_cells(cv, cp, lambda p: p not in held)
    except StateLayoutError:
        return None
    if cells == cp.cells:
        return None  # nothing in common: keep it whole
    if not cells:  # the state's window holds all of it
        return b"".join([cv[: HEAD.size], U32.pack(1), U32.pack(0)]), low
    return b"".join([cv[: HEAD.size], U32.pack(1), U32.pack(cells), *pieces]), low


def window_at(gap: Bytes, state: Bytes, low: int, n_tokens: int, shape: MemoryShape) -> bytes:
    """``window_gap``'s inverse: the checkpoint of positions ``low`` to ``n_tokens``, its cells
    the gap's then the state's window cells in that range. Raises StateLayoutError when the
    two do not fit together."""
    gv, sv = memoryview(gap).cast("B"), memoryview(state).cast("B")
    caches = _kv_only(sv, shape)
    if caches is None or len(caches) < 2:
        raise StateLayoutError("not a state with a window cache")
    window = caches[-1]
    (g,), _ = parse_sections(gv, _ONE_CACHE)
    if window.section is None or (g.section is not None and g.rows != window.rows):
        raise StateLayoutError("gap and state of different layouts")
    w_cells, w_pieces = _window_cells(sv, window, lambda p: low <= p < n_tokens)
    if g.section is None or g.rows is None:  # the state's window holds all of it
        return b"".join([gv[: HEAD.size], U32.pack(1), U32.pack(w_cells), *w_pieces])
    _, g_pieces = _stream_parts(gv, g, [(0, g.cells)])
    # Both in runs: the gap's one, the state's ``len(w_runs)``; per layer a header then rows.
    w_runs = _runs([low <= p < n_tokens for p in _positions(sv, window)])
    k = len(w_runs)
    out: list[Any] = [
        gv[: HEAD.size],
        U32.pack(1),
        U32.pack(g.cells + w_cells),
        g_pieces[0],
        *w_pieces[:k],
        g_pieces[1],
    ]
    gi, wi = 2, k + 1
    v_trans, k_rows, v_rows = g.rows
    for _ in k_rows:
        out += [g_pieces[gi], g_pieces[gi + 1], *w_pieces[wi + 1 : wi + 1 + k]]
        gi, wi = gi + 2, wi + 1 + k
    for v in v_rows:
        if v_trans:
            out.append(g_pieces[gi])
            for j in range(v[2]):
                out += [g_pieces[gi + 1 + j], *w_pieces[wi + 1 + j * k : wi + 1 + (j + 1) * k]]
            gi, wi = gi + 1 + v[2], wi + 1 + v[2] * k
        else:
            out += [g_pieces[gi], g_pieces[gi + 1], *w_pieces[wi + 1 : wi + 1 + k]]
            gi, wi = gi + 2, wi + 1 + k
    return b"".join(out)
