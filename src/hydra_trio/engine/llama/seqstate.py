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

What is built on this reading lives apart: statematch.py compares layouts for admission (K/V
types, row sizes, a recurrent state's rows), statesplice.py splices states for the prompt
cache's storage (shared heads, window checkpoint gaps), both with the constants and
``parse_sections`` this module exposes.

Pure: no llama_cpp import. The layout read here is llama.cpp's (``llama_kv_cache::
state_write``, ``llama_memory_recurrent::state_write``, checked against the vendored 0.3.36
source); anything that does not parse exactly is left as it is, for llama.cpp to accept or
refuse.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

STATE_MAGIC = 0xAF143CD8  # llama-context.cpp io_magic
U32 = struct.Struct("<I")
HEAD = struct.Struct("<Ii")  # magic, seq_id
ROW = struct.Struct("<iQ")  # ggml type, row size in bytes
VTRANS = struct.Struct("<iII")  # ggml type, element size, n_embd_v_gqa
CELL_META = 12  # per cell of a single-sequence state: pos i32, n_seq_id u32 (= 1), seq_id i32
_REC_CELL = struct.Struct("<iI")  # a recurrent cell of a single-sequence state: pos, n_seq_id (= 0)
_REC_ROW = struct.Struct("<iQ")  # a recurrent layer's ggml type and row size
_U64 = struct.Struct("<Q")
_MAX_STREAMS = 4096

Bytes = bytes | bytearray | memoryview


class StateLayoutError(ValueError):
    """The bytes are not a sequence state in the layout this module knows."""


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
class CacheSection:
    """One section of a sequence state, as read from its bytes: a KV cache (its streams, the
    one the sequence's cells are in) or the recurrent state."""

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
    off += CELL_META * cells
    v_trans, n_layer = struct.unpack_from("<II", view, off)
    off += 8
    if v_trans > 1 or n_layer > 4096:
        raise StateLayoutError("not a KV stream section")
    k_rows, v_rows = [], []
    for _ in range(n_layer):  # K rows
        k_type, row = ROW.unpack_from(view, off)
        off += ROW.size + cells * row
        k_rows.append((k_type, row))
    for _ in range(n_layer):  # V rows (every layer has V in the models this engine serves)
        if v_trans:
            v_type, el, n_embd = VTRANS.unpack_from(view, off)
            off += VTRANS.size + n_embd * cells * el
            v_rows.append((v_type, el, n_embd))
        else:
            v_type, row = ROW.unpack_from(view, off)
            off += ROW.size + cells * row
            v_rows.append((v_type, row))
    if off > len(view):
        raise StateLayoutError("KV stream section runs past the end of the state")
    return off, (v_trans, tuple(k_rows), tuple(v_rows))


def _recurrent_section(view: memoryview, start: int, shape: RecurrentShape) -> CacheSection:
    """The recurrent section at ``start`` (its cell_count), read as ``shape`` lays it out."""
    (cells,) = U32.unpack_from(view, start)
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
    return CacheSection(0, 0, (start, off), cells, None, positions, (n_layer, tuple(r_rows), tuple(s_rows)))


@dataclass(frozen=True, slots=True)
class StateLayout:
    """What a sequence state holds, read from its bytes without llama.cpp."""

    caches: tuple[CacheSection, ...]
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
    caches, end = parse_sections(memoryview(state).cast("B"), shape)
    return StateLayout(tuple(caches), end)


def learn_shape(state: Bytes, *, n_kv: int | None, recurrent: bool) -> MemoryShape:
    """The shape of the states a context writes, read off one it wrote (nothing after it) of
    a sequence holding a position: ``n_kv`` KV caches (None: as many as there are; a model
    with a recurrent state must say), then the recurrent state when ``recurrent``: the one
    count of its writing layers, with or without PLE conv rows, that reads the state to its
    end. Raises StateLayoutError when none does."""
    view = memoryview(state).cast("B")
    if not recurrent:
        caches, _ = parse_sections(view, MemoryShape(n_kv))
        return MemoryShape(len(caches))
    if n_kv is None:
        raise ValueError("a recurrent state's KV cache count must be given")
    _, start = parse_sections(view, MemoryShape(n_kv), allow_empty=True)
    try:
        (cells,) = U32.unpack_from(view, start)
        _, n_layer = struct.unpack_from("<II", view, start + 4 + _REC_CELL.size * cells)
    except struct.error as exc:
        raise StateLayoutError(f"state truncated: {exc}") from None
    for n_rows in range(min(n_layer, 4096), 0, -1):
        for ple in (False, True):
            shape = MemoryShape(n_kv, RecurrentShape(n_rows, ple))
            try:
                if parse_sections(view, shape)[1] == len(view):
                    return shape
            except StateLayoutError:
                continue
    raise StateLayoutError("no recurrent row layout reads the state to its end")


def parse_sections(
    view: memoryview, shape: MemoryShape, *, allow_empty: bool = False
) -> tuple[list[CacheSection], int]:
    """The sections of a state and where they end: ``shape.n_kv`` KV caches (None: as many as
    the bytes hold), then its recurrent section; what follows (a blob's logits) is not read."""
    if len(view) < HEAD.size:
        raise StateLayoutError("state too short")
    magic, _seq = HEAD.unpack_from(view, 0)
    if magic != STATE_MAGIC:
        raise StateLayoutError("not a llama.cpp sequence state (magic)")
    off = HEAD.size
    caches: list[CacheSection] = []
    n_kv = shape.n_kv
    try:
        while (len(caches) < n_kv) if n_kv is not None else (off < len(view)):
            (n_stream,) = U32.unpack_from(view, off)
            off += 4
            if not 1 <= n_stream <= _MAX_STREAMS:
                raise StateLayoutError(f"stream count {n_stream}")
            section: tuple[int, int] | None = None
            index = n_cells = 0
            rows: Rows | None = None
            for i in range(n_stream):
                start = off
                (cells,) = U32.unpack_from(view, off)
                off += 4
                if cells:
                    if section is not None:
                        raise StateLayoutError("more than one non-empty stream: not one sequence")
                    off, rows = _section_end(view, off, cells)
                    section, index, n_cells = (start, off), i, cells
            caches.append(
                CacheSection(n_stream, index, section, n_cells, rows, n_cells)
                if section
                else CacheSection(n_stream, 0, None)
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
    caches, end = parse_sections(view, shape)
    if all(c.recurrent or (c.n_stream == n_stream and (c.section is None or c.index == stream)) for c in caches):
        return None
    pieces: list[_Piece] = [(0, HEAD.size)]
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
    count = U32.pack(n_stream)
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
    count = U32.pack(n_stream)
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
