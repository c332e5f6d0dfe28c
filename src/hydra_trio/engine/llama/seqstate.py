"""llama.cpp's sequence state between KV layouts: the one-stream form every blob travels in.

``llama_state_seq_get_data`` writes a sequence's memory section by section: each KV cache
(one, or two for an iSWA model) as ``[n_stream u32]`` then, for each of the context's KV
streams, ``[cell_count u32]`` and, when not empty, that stream's cells and rows; then, on a
recurrent or hybrid model, the recurrent state (``llama_memory_recurrent::state_write``):
``[cell_count u32]``, the cells, and the R and S rows, with no stream count, since it is one
pool of per-sequence states whatever the KV layout. A unified cache has one stream; a split
cache (``--kv-unified`` off) has one per slot, and llama.cpp refuses a state whose stream
count differs from its own. A sequence lives in one stream, so its state holds one non-empty
stream per cache and nothing is lost by rewriting the stream count: blobs leave the engine
in the one-stream form (what a unified engine writes, so the wire format does not change
with the layout) and are rewritten into the local form, the slot's own stream, on restore.
The recurrent section travels as it is.

Which sections a state holds is the model's (``MemoryShape``), not something its bytes say:
a recurrent section starts with a cell count where a KV one has a stream count, and names its
layers' count but not how many of them write rows. ``learn_shape`` reads it off a state the
local context wrote.

Pure: no llama_cpp import. The layout read here is llama.cpp's (``llama_kv_cache::
state_write``, ``llama_memory_recurrent::state_write``, checked against the vendored 0.3.36
source); anything that does not parse exactly is left as it is, for llama.cpp to accept or
refuse.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...config import CACHE_TYPES

STATE_MAGIC = 0xAF143CD8  # llama-context.cpp io_magic
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<Ii")  # magic, seq_id
_ROW = struct.Struct("<iQ")  # ggml type, row size in bytes
_VTRANS = struct.Struct("<iII")  # ggml type, element size, n_embd_v_gqa
_CELL_META = 12  # per cell of a single-sequence state: pos i32, n_seq_id u32 (= 1), seq_id i32
_REC_CELL = struct.Struct("<iI")  # a recurrent cell of a single-sequence state: pos, n_seq_id (= 0)
_REC_ROW = struct.Struct("<iQ")  # a recurrent layer's ggml type and row size
_U64 = struct.Struct("<Q")
_MAX_STREAMS = 4096

Bytes = bytes | bytearray | memoryview


class StateLayoutError(ValueError):
    """The bytes are not a sequence state in the layout this module knows."""


# ggml type ids of the K/V cache types llama-server offers, for messages.
_GGML_TYPES = {t: name for name, t in CACHE_TYPES.items()}

# A stream's rows: V transposed or not, then per layer (type, row bytes) of K and of V (for a
# transposed V: (type, element bytes, n_embd_v_gqa)).
Rows = tuple[int, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]
# A recurrent section's rows: n_layer as written, then per writing layer (R type, R row bytes,
# PLE conv row bytes or 0) and (S type, S row bytes).
StateRows = tuple[int, tuple[tuple[int, int, int], ...], tuple[tuple[int, int], ...]]


@dataclass(frozen=True, slots=True)
class RecurrentShape:
    """What a recurrent section's bytes do not say: how many layers write rows (a hybrid's
    attention layers write none, yet its n_layer counts them), and whether a PLE conv row
    follows each R row."""

    n_rows: int
    ple: bool = False


@dataclass(frozen=True, slots=True)
class MemoryShape:
    """The sections of a context's sequence state, in order: ``n_kv`` KV caches (None: as many
    as the bytes hold, on a model with no recurrent state), then the recurrent state."""

    n_kv: int | None = None
    recurrent: RecurrentShape | None = None


KV_ONLY = MemoryShape()  # KV caches only, as many as the bytes hold


@dataclass(frozen=True, slots=True)
class _Cache:
    n_stream: int  # 0: the recurrent section, which has no streams
    index: int  # the stream the sequence's cells are in
    # (start, end) of that stream's cell_count + data (None: empty); the recurrent section's
    # whole extent, empty or not (it travels as it is).
    section: tuple[int, int] | None
    cells: int = 0
    rows: Rows | None = None
    positions: int = 0  # the positions the section holds
    state_rows: StateRows | None = None  # the recurrent section's

    @property
    def recurrent(self) -> bool:
        return self.n_stream == 0


def _section_end(view: memoryview, off: int, cells: int) -> tuple[int, Rows]:
    """The end and the row layout of one stream's cells (``off``: just after its cell_count)."""
    off += _CELL_META * cells
    v_trans, n_layer = struct.unpack_from("<II", view, off)
    off += 8
    if v_trans > 1 or n_layer > 4096:
        raise StateLayoutError("not a KV stream section")
    k_rows, v_rows = [], []
    for _ in range(n_layer):  # K rows
        k_type, row = _ROW.unpack_from(view, off)
        off += _ROW.size + cells * row
        k_rows.append((k_type, row))
    for _ in range(n_layer):  # V rows (every layer has V in the models this engine serves)
        if v_trans:
            v_type, el, n_embd = _VTRANS.unpack_from(view, off)
            off += _VTRANS.size + n_embd * cells * el
            v_rows.append((v_type, el, n_embd))
        else:
            v_type, row = _ROW.unpack_from(view, off)
            off += _ROW.size + cells * row
            v_rows.append((v_type, row))
    if off > len(view):
        raise StateLayoutError("KV stream section runs past the end of the state")
    return off, (v_trans, tuple(k_rows), tuple(v_rows))


def _recurrent_section(view: memoryview, start: int, shape: RecurrentShape) -> _Cache:
    """The recurrent section at ``start`` (its cell_count), read as ``shape`` lays it out."""
    (cells,) = _U32.unpack_from(view, start)
    if cells > _MAX_STREAMS:  # one state per sequence: at most as many as a context has sequences
        raise StateLayoutError(f"recurrent cell count {cells}")
    off = start + 4
    positions = 0
    for _ in range(cells):
        pos, n_seq_id = _REC_CELL.unpack_from(view, off)
        off += _REC_CELL.size
        if n_seq_id != 0:  # a single sequence's cells name no sequence (state_write_meta)
            raise StateLayoutError("a recurrent cell listing sequences: not one sequence's state")
        positions = max(positions, pos + 1)
    s_trans, n_layer = struct.unpack_from("<II", view, off)
    off += 8
    if s_trans != 0 or not shape.n_rows <= n_layer <= 4096:  # llama.cpp writes S untransposed
        raise StateLayoutError("not a recurrent state section")
    r_rows: list[tuple[int, int, int]] = []
    s_rows: list[tuple[int, int]] = []
    for _ in range(shape.n_rows):
        r_type, row = _REC_ROW.unpack_from(view, off)
        off += _REC_ROW.size + cells * row
        ple = 0
        if shape.ple:
            (ple,) = _U64.unpack_from(view, off)
            off += _U64.size + cells * ple
        r_rows.append((r_type, row, ple))
    for _ in range(shape.n_rows):
        s_type, row = _REC_ROW.unpack_from(view, off)
        off += _REC_ROW.size + cells * row
        s_rows.append((s_type, row))
    if off > len(view):
        raise StateLayoutError("recurrent state section runs past the end of the state")
    return _Cache(0, 0, (start, off), cells, None, positions, (n_layer, tuple(r_rows), tuple(s_rows)))


@dataclass(frozen=True, slots=True)
class StateLayout:
    """What a sequence state holds, read from its bytes without llama.cpp."""

    caches: tuple[_Cache, ...]
    end: int  # where the caches end (a blob's logits may follow)

    @property
    def n_past(self) -> int:
        """Positions held: the first section (full attention, or the recurrent state) holds
        them all."""
        return self.caches[0].positions

    @property
    def n_kv(self) -> int:
        """Its KV caches: the sections with a stream count."""
        return sum(not c.recurrent for c in self.caches)


def read_layout(state: Bytes, shape: MemoryShape = KV_ONLY) -> StateLayout:
    """The sections of a state laid out as ``shape``."""
    caches, end = _parse(memoryview(state).cast("B"), shape)
    return StateLayout(tuple(caches), end)


def learn_shape(state: Bytes, *, n_kv: int | None, recurrent: bool) -> MemoryShape:
    """The shape of the states a context writes, read off one it wrote (nothing after it) of
    a sequence holding a position: ``n_kv`` KV caches (None: as many as there are; a model
    with a recurrent state must say), then the recurrent state when ``recurrent``: the one
    count of its writing layers, with or without PLE conv rows, that reads the state to its
    end. Raises StateLayoutError when none does."""
    view = memoryview(state).cast("B")
    if not recurrent:
        caches, _ = _parse(view, MemoryShape(n_kv))
        return MemoryShape(len(caches))
    if n_kv is None:
        raise ValueError("a recurrent state's KV cache count must be given")
    _, start = _parse(view, MemoryShape(n_kv), allow_empty=True)
    try:
        (cells,) = _U32.unpack_from(view, start)
        _, n_layer = struct.unpack_from("<II", view, start + 4 + _REC_CELL.size * cells)
    except struct.error as exc:
        raise StateLayoutError(f"state truncated: {exc}") from None
    for n_rows in range(min(n_layer, 4096), 0, -1):
        for ple in (False, True):
            shape = MemoryShape(n_kv, RecurrentShape(n_rows, ple))
            try:
                if _parse(view, shape)[1] == len(view):
                    return shape
            except StateLayoutError:
                continue
    raise StateLayoutError("no recurrent row layout reads the state to its end")


def type_name(t: int) -> str:
    """llama-server's cache-type name of a ggml type id (CACHE_TYPES), for messages."""
    return _GGML_TYPES.get(t, f"ggml type {t}")


def cache_layout(layout: StateLayout) -> dict[str, object]:
    """The KV cache layout a state was written in, as INFO, /version and kv_transfer_params
    report it: the K and V types and whether V rows are transposed (flash attention off).
    Empty for a recurrent model: it has no K/V cache (its recurrent rows are f32 always)."""
    rows = next((c.rows for c in layout.caches if c.rows is not None), None)
    if rows is None or not rows[1]:
        return {}
    v_trans, k_rows, v_rows = rows
    return {"type_k": type_name(k_rows[0][0]), "type_v": type_name(v_rows[0][0]), "v_trans": bool(v_trans)}


def cache_layout_mismatch(got: dict[str, object], local: dict[str, object]) -> str | None:
    """Why KV reported as ``got`` (kv_transfer_params, before any byte moves) cannot go into
    a context of ``local``, or None (also when either says nothing)."""
    for key, what in (("type_k", "K cache type"), ("type_v", "V cache type"), ("v_trans", "V transposition")):
        if key in got and key in local and got[key] != local[key]:
            return f"{what} {got[key]}, here {local[key]}"
    return None


def layout_mismatch(got: StateLayout, local: StateLayout) -> str | None:
    """Why a received state cannot go into this context (its K/V types, row sizes, layer
    counts or V transposition differ), or None. Compared per cache, where both hold cells."""
    if len(got.caches) != len(local.caches):
        return f"{len(got.caches)} KV caches, the resident model has {len(local.caches)}"
    for i, (a, b) in enumerate(zip(got.caches, local.caches, strict=True)):
        where = f"cache {i}: " if len(local.caches) > 1 else ""
        if a.recurrent or b.recurrent:
            why = _recurrent_mismatch(a.state_rows, b.state_rows)
            if why is not None:
                return f"{where}{why}"
            continue
        if a.rows is None or b.rows is None or a.rows == b.rows:
            continue
        (vt_a, k_a, v_a), (vt_b, k_b, v_b) = a.rows, b.rows
        if vt_a != vt_b:
            what = "transposed" if vt_a else "not transposed"
            return (
                f"{where}V rows {what} (flash attention {'off' if vt_a else 'on'} "
                "where the KV was made), here the opposite"
            )
        if len(k_a) != len(k_b):
            return f"{where}{len(k_a)} layers, the resident model has {len(k_b)}"
        if (
            said := _rows_mismatch(f"{where}layer", ("K/V cache types", "K/V row sizes"), (k_a, v_a), (k_b, v_b))
        ) is not None:
            return said
    return None


def _rows_mismatch(
    label: str,
    says: tuple[str, str],
    got: tuple[Sequence[Any], Sequence[Any]],
    local: tuple[Sequence[Any], Sequence[Any]],
) -> str | None:
    """The first layer whose pair of row shapes (K/V, or a recurrent state's R/S) differs: its
    types, else its sizes; None: all the same."""
    for layer, (xa, xb, ya, yb) in enumerate(zip(got[0], local[0], got[1], local[1], strict=True)):
        if xa[0] != xb[0] or ya[0] != yb[0]:
            return (
                f"{label} {layer}: {says[0]} {type_name(xa[0])}/{type_name(ya[0])}, here "
                f"{type_name(xb[0])}/{type_name(yb[0])}"
            )
        if xa != xb or ya != yb:
            return f"{label} {layer}: {says[1]} {xa[1:]}/{ya[1:]}, here {xb[1:]}/{yb[1:]}"
    return None


def _recurrent_mismatch(got: StateRows | None, local: StateRows | None) -> str | None:
    if got is None or local is None:
        return "a recurrent state where the resident model has a KV cache, or the reverse"
    if got == local:
        return None
    (n_a, r_a, s_a), (n_b, r_b, s_b) = got, local
    if n_a != n_b:
        return f"recurrent state of {n_a} layers, the resident model has {n_b}"
    return (
        _rows_mismatch("recurrent row", ("R/S types", "R/S row sizes"), (r_a, s_a), (r_b, s_b))
        or "recurrent state rows differ"
    )


def _parse(view: memoryview, shape: MemoryShape, *, allow_empty: bool = False) -> tuple[list[_Cache], int]:
    """The sections of a state and where they end: ``shape.n_kv`` KV caches (None: as many as
    the bytes hold), then its recurrent section; what follows (a blob's logits) is not read."""
    if len(view) < _HEAD.size:
        raise StateLayoutError("state too short")
    magic, _seq = _HEAD.unpack_from(view, 0)
    if magic != STATE_MAGIC:
        raise StateLayoutError("not a llama.cpp sequence state (magic)")
    off = _HEAD.size
    caches: list[_Cache] = []
    n_kv = shape.n_kv
    try:
        while (len(caches) < n_kv) if n_kv is not None else (off < len(view)):
            (n_stream,) = _U32.unpack_from(view, off)
            off += 4
            if not 1 <= n_stream <= _MAX_STREAMS:
                raise StateLayoutError(f"stream count {n_stream}")
            section: tuple[int, int] | None = None
            index = n_cells = 0
            rows: Rows | None = None
            for i in range(n_stream):
                start = off
                (cells,) = _U32.unpack_from(view, off)
                off += 4
                if cells:
                    if section is not None:
                        raise StateLayoutError("more than one non-empty stream: not one sequence")
                    off, rows = _section_end(view, off, cells)
                    section, index, n_cells = (start, off), i, cells
            caches.append(
                _Cache(n_stream, index, section, n_cells, rows, n_cells) if section else _Cache(n_stream, 0, None)
            )
        if shape.recurrent is not None:
            caches.append(rec := _recurrent_section(view, off, shape.recurrent))
            assert rec.section is not None
            off = rec.section[1]
    except struct.error as exc:
        raise StateLayoutError(f"state truncated: {exc}") from None
    except OverflowError:  # a row size or count from the bytes puts an offset past any buffer
        raise StateLayoutError("a row size or cell count runs past the end of the state") from None
    if not caches and not allow_empty:
        raise StateLayoutError("state holds no KV cache")
    return caches, off


# An output piece: (source start, source end) of bytes to copy, or the number of zero bytes.
_Piece = tuple[int, int] | int


def _plan(view: memoryview, n_stream: int, stream: int, shape: MemoryShape) -> list[_Piece] | None:
    """The pieces of the state rewritten for ``n_stream`` streams, the sequence in
    ``stream``; None when it already has that form."""
    if not 0 <= stream < n_stream:
        raise ValueError(f"stream {stream} outside 0..{n_stream - 1}")
    caches, end = _parse(view, shape)
    if all(c.recurrent or (c.n_stream == n_stream and (c.section is None or c.index == stream)) for c in caches):
        return None
    pieces: list[_Piece] = [(0, _HEAD.size)]
    for cache in caches:
        if cache.recurrent:  # one pool of states whatever the layout: as it is
            assert cache.section is not None
            pieces.append(cache.section)
            continue
        pieces.append(-1)  # the stream count, written by the caller
        if cache.section is None:
            pieces.append(4 * n_stream)
        else:
            pieces += [4 * stream, cache.section, 4 * (n_stream - 1 - stream)]
    pieces.append((end, len(view)))  # what follows the caches (a blob's logits)
    return [p for p in pieces if p != 0]


def _size(piece: _Piece) -> int:
    return 4 if piece == -1 else piece if isinstance(piece, int) else piece[1] - piece[0]


def with_streams(state: Bytes, n_stream: int, stream: int, shape: MemoryShape) -> Bytes:
    """The state rewritten for a context of ``n_stream`` KV streams, the sequence's cells in
    stream ``stream``; bytes after its sections (a blob's logits) follow as they are.
    Returns ``state`` itself when it already has that form; raises StateLayoutError when it
    does not parse as ``shape``."""
    view = memoryview(state).cast("B")
    plan = _plan(view, n_stream, stream, shape)
    if plan is None:
        return state
    count = _U32.pack(n_stream)
    return b"".join(count if p == -1 else bytes(p) if isinstance(p, int) else view[p[0] : p[1]] for p in plan)


def rewrite_in_place(buf: memoryview, start: int, n_stream: int, stream: int, shape: MemoryShape) -> memoryview | None:
    """``with_streams`` without a copy: the state is ``buf[start:]`` and the ``start`` bytes
    before it are free to overwrite. Returns the view of ``buf`` now holding the rewritten
    state (``buf[start:]`` itself when nothing changes), or None when the bytes before it are
    too few for what the rewrite adds (copy it then)."""
    state = buf[start:]
    plan = _plan(state, n_stream, stream, shape)
    if plan is None:
        return state
    # Every piece moves left (or stays), so copying them in order never overwrites a byte
    # still to be read: the output starts far enough left for its furthest-right shift.
    shift = out = 0
    for piece in plan:
        if isinstance(piece, tuple):
            shift = max(shift, out - piece[0])
        out += _size(piece)
    shift = max(shift, out - len(state))
    if shift > start:
        return None
    dst = start - shift
    first = dst
    count = _U32.pack(n_stream)
    for piece in plan:
        n = _size(piece)
        if piece == -1:
            buf[dst : dst + 4] = count
        elif isinstance(piece, int):
            buf[dst : dst + n] = bytes(n)
        else:
            buf[dst : dst + n] = buf[start + piece[0] : start + piece[1]]
        dst += n
    return buf[first:dst]


# ---- a history's first positions held apart (the prompt cache's shared prefixes) ------------
#
# A sequence's KV is per cell: its position (the cell's metadata) and one row per layer, so
# the cells of the first KV cache (full attention: every position) split by position into a
# head and the rest, and two such parts of the same history join back into the state
# llama.cpp wrote (cells in another order: a restore places each by its own position). A
# head computed by one history serves every history that starts with the same tokens: the
# prompt cache keeps it once for all of them (kv/promptcache.py). The other caches (an iSWA
# model's window) stay whole with the rest. Parts are in the one-stream form.


def _stream_parts(view: memoryview, cache: _Cache, keep: Sequence[tuple[int, int]]) -> tuple[int, list[Any]]:
    """The cells ``keep`` (runs of cell indices) of one KV stream section: (cells, pieces of
    its bytes after the cell count)."""
    assert cache.section is not None and cache.rows is not None
    n = cache.cells
    off = cache.section[0] + 4
    pieces: list[Any] = [view[off + _CELL_META * a : off + _CELL_META * b] for a, b in keep]
    off += _CELL_META * n
    pieces.append(view[off : off + 8])  # v_trans, n_layer
    off += 8
    v_trans, k_rows, v_rows = cache.rows
    for _, row in k_rows:
        pieces.append(view[off : off + _ROW.size])
        off += _ROW.size
        pieces += [view[off + row * a : off + row * b] for a, b in keep]
        off += n * row
    for v in v_rows:
        if v_trans:
            _, el, n_embd = v
            pieces.append(view[off : off + _VTRANS.size])
            off += _VTRANS.size
            for j in range(n_embd):
                base = off + j * n * el
                pieces += [view[base + el * a : base + el * b] for a, b in keep]
            off += n_embd * n * el
        else:
            row = v[1]
            pieces.append(view[off : off + _ROW.size])
            off += _ROW.size
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


def _kv_only(view: memoryview, shape: MemoryShape) -> list[_Cache] | None:
    """The caches of a KV-only state whose first cache holds every position once (else None:
    a recurrent state, or a first cache that is a window)."""
    if shape.recurrent is not None:
        return None
    caches, _ = _parse(view, shape)
    first = caches[0] if caches else None
    if first is None or first.section is None or first.recurrent:
        return None
    return caches


def _positions(view: memoryview, cache: _Cache) -> list[int]:
    assert cache.section is not None
    off = cache.section[0] + 4
    return [struct.unpack_from("<i", view, off + _CELL_META * i)[0] for i in range(cache.cells)]


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
        end = _parse(view, shape)[1]
        pos = _positions(view, caches[0])
    except StateLayoutError:
        return None
    below = [p < n for p in pos]
    if sum(below) != n or len(set(p for p in pos if p < n)) != n or sum(below) == len(pos):
        return None
    head: list[Any] = [view[: _HEAD.size]]
    rest: list[Any] = [view[: _HEAD.size]]
    for i, cache in enumerate(caches):
        if i == 0:
            for part, keep in ((head, _runs(below)), (rest, _runs([not b for b in below]))):
                cells, pieces = _stream_parts(view, cache, keep)
                part += [_U32.pack(1), _U32.pack(cells), *pieces]
            continue
        head.append(_U32.pack(1) + _U32.pack(0))
        if cache.section is None:
            rest.append(_U32.pack(1) + _U32.pack(0))
        else:
            rest += [_U32.pack(1), view[cache.section[0] : cache.section[1]]]
    return b"".join(head), b"".join(rest), end


def join_head(head: Bytes, rest: Bytes, shape: MemoryShape) -> list[Bytes]:
    """``split_head``'s two parts as one state again (its pieces, to copy once): the head's
    cells then the rest's in the first KV cache, the rest's other caches as they are. What
    follows ``rest``'s caches (a blob's logits) follows the joined state. Raises
    StateLayoutError when they are not two such parts of one model's state."""
    hv, rv = memoryview(head).cast("B"), memoryview(rest).cast("B")
    h_caches, _ = _parse(hv, shape)
    r_caches, r_end = _parse(rv, shape)
    if len(h_caches) != len(r_caches) or any(c.recurrent for c in r_caches):
        raise StateLayoutError("head and rest of different states")
    h0, r0 = h_caches[0], r_caches[0]
    if h0.section is None or h0.rows is None:
        raise StateLayoutError("an empty head")
    if r0.section is None:  # nothing of the first cache past the head
        first = [_U32.pack(1), hv[h0.section[0] : h0.section[1]]]
    else:
        if r0.rows != h0.rows:
            raise StateLayoutError("head and rest of different KV layouts")
        _, h_pieces = _stream_parts(hv, h0, [(0, h0.cells)])
        _, r_pieces = _stream_parts(rv, r0, [(0, r0.cells)])
        first = [_U32.pack(1), _U32.pack(h0.cells + r0.cells), h_pieces[0], r_pieces[0], h_pieces[1]]
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
    out: list[Bytes] = [rv[: _HEAD.size], *first]
    for cache in r_caches[1:]:
        out.append(_U32.pack(1) + _U32.pack(0) if cache.section is None else _U32.pack(1))
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


def _window_cells(view: memoryview, cache: _Cache, keep: Callable[[int], bool]) -> tuple[int, list[Any]]:
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
        (cp,), _ = _parse(cv, _ONE_CACHE)
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
        return b"".join([cv[: _HEAD.size], _U32.pack(1), _U32.pack(0)]), low
    return b"".join([cv[: _HEAD.size], _U32.pack(1), _U32.pack(cells), *pieces]), low


def window_at(gap: Bytes, state: Bytes, low: int, n_tokens: int, shape: MemoryShape) -> bytes:
    """``window_gap``'s inverse: the checkpoint of positions ``low`` to ``n_tokens``, its cells
    the gap's then the state's window cells in that range. Raises StateLayoutError when the
    two do not fit together."""
    gv, sv = memoryview(gap).cast("B"), memoryview(state).cast("B")
    caches = _kv_only(sv, shape)
    if caches is None or len(caches) < 2:
        raise StateLayoutError("not a state with a window cache")
    window = caches[-1]
    (g,), _ = _parse(gv, _ONE_CACHE)
    if window.section is None or (g.section is not None and g.rows != window.rows):
        raise StateLayoutError("gap and state of different layouts")
    w_cells, w_pieces = _window_cells(sv, window, lambda p: low <= p < n_tokens)
    if g.section is None or g.rows is None:  # the state's window holds all of it
        return b"".join([gv[: _HEAD.size], _U32.pack(1), _U32.pack(w_cells), *w_pieces])
    _, g_pieces = _stream_parts(gv, g, [(0, g.cells)])
    # Both in runs: the gap's one, the state's ``len(w_runs)``; per layer a header then rows.
    w_runs = _runs([low <= p < n_tokens for p in _positions(sv, window)])
    k = len(w_runs)
    out: list[Any] = [
        gv[: _HEAD.size],
        _U32.pack(1),
        _U32.pack(g.cells + w_cells),
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
