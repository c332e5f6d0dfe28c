"""A slot's KV state out of and into llama.cpp: sizes, snapshots for the prompt cache, the
one-stream form blobs travel in, and the all-or-nothing restore.

Half of LlamaBackend (context.py), kept apart because it is its own subject: how llama.cpp
lays a sequence's state out (seqstate.py reads it without llama.cpp) and what a restore may
and may not touch. It uses the context's attributes, set by LlamaBackend.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import llama_cpp

from ...wire.errors import ErrorCode, ProtocolError
from ...wire.kvblob import Checkpoint as BlobCheckpoint
from ...wire.kvblob import split_trailing_logits
from .checkpoints import Checkpoint, Checkpoints, reusable_in_state, window_holds
from .seqstate import (
    MemoryShape,
    StateLayout,
    StateLayoutError,
    learn_shape,
    read_layout,
    rewrite_in_place,
    with_streams,
)
from .statematch import cache_layout, layout_mismatch
from .statesplice import join_head, split_head, window_at, window_gap
from .types import LoraSet, ModelInfo


@dataclass(slots=True)
class Snapshot:
    """A slot's KV copied out: ``buf[offset:]`` is the state (then the tail logits, when
    ``has_logits``); the ``offset`` bytes before it give a restore room to rewrite it."""

    tokens: list[int]
    buf: bytearray
    offset: int
    has_logits: bool
    salt: str | None = None  # the cache_salt the history was computed under
    lora: LoraSet = ()  # and the LoRA adapter set
    # How its state is laid out, when its first positions can be held apart (statesplice.py
    # ``split_head``: a KV-only state this context wrote); None: they cannot.
    shape: MemoryShape | None = None
    # The slot's latest context checkpoint (an iSWA window or a recurrent state, at fewer
    # positions): a prompt that diverges from this history before its end (a reply rendered
    # otherwise than it was generated) resumes there instead of computing it all again.
    checkpoint: Checkpoint | None = None
    # Its data holds only the window cells the state lacks (statesplice.py ``window_gap``): the
    # backend makes it whole again on restore (``LlamaBackend.checkpoint_of``).
    checkpoint_gap: bool = False

    @property
    def order(self) -> tuple[str, LoraSet, list[int]]:
        """Where the entry sorts: by salt (validated non-empty: "" is "unsalted"), adapter
        set, then tokens."""
        return (self.salt or "", self.lora, self.tokens)

    @property
    def nbytes(self) -> int:
        return len(self.buf) + (len(self.checkpoint.data) if self.checkpoint is not None else 0)

    def split(self, n: int) -> tuple[bytes, Snapshot] | None:
        """Its first ``n`` positions apart: (their state, a head other histories of the same
        first tokens can share; this snapshot without them, the same tokens and logits, to be
        ``joined`` to such a head again). None when its state does not split so."""
        if self.shape is None:
            return None
        view = memoryview(self.buf)[self.offset :]
        parts = split_head(view, n, self.shape)
        if parts is None:
            return None
        head, rest, end = parts
        buf = bytearray(self.offset + len(rest) + len(view) - end)
        buf[self.offset : self.offset + len(rest)] = rest
        buf[self.offset + len(rest) :] = view[end:]
        return head, replace(self, buf=buf)

    def joined(self, head: bytes) -> Snapshot:
        """What ``split`` took apart, whole again: a snapshot a slot restores (one copy)."""
        assert self.shape is not None
        pieces = join_head(head, memoryview(self.buf)[self.offset :], self.shape)
        buf = bytearray(self.offset + sum(len(p) for p in pieces))
        at = self.offset
        for piece in pieces:
            buf[at : at + len(piece)] = piece
            at += len(piece)
        return replace(self, buf=buf)

log = logging.getLogger(__name__)

# A sequence's partial state: its SWA layers' cells, or its recurrent state (llama.h).
_PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY

# Sliding-window architectures whose window is not a sequence's last n_swa positions
# (llama_hparams::is_masked_swa: llama4's chunks; the symmetric window of two encoders): their
# SWA cell count is asked of llama.cpp, not computed (``_swa_cells``).
_WINDOW_NOT_TRAILING = frozenset({b"llama4", b"gemma-embedding", b"modern-bert"})


class DecodeAborted(Exception):
    """llama_decode was stopped by the abort flag; the batch's cells were removed."""


class NoKvSpace(Exception):
    """llama_decode found no free KV cell: the shared context is full."""


class SlotStates:
    """The state half of LlamaBackend. What it reads of the context is declared here; the
    slot methods it calls (clear_slot, pool_is_tight, _advanced, scratch_seq) are the
    context's."""

    _ctx: ctypes.c_void_p | None
    _mem: ctypes.c_void_p
    info: ModelInfo
    kv_unified: bool
    n_slots: int
    n_stream: int
    n_ctx_slot: int
    n_swa: int
    seq_tokens: list[list[int]]
    seq_salt: list[str | None]
    seq_lora: list[LoraSet]
    tail_logits: list[bytes | None]
    state_layout: StateLayout | None
    _shape: MemoryShape
    _stream_overhead: int
    _kept: list[int]
    _swa_low: list[int]
    checkpoints: Checkpoints
    checkpoint_size: int | None
    _model: ctypes.c_void_p
    _sizes: list[int]
    _swa_n: list[int]

    def _measure_state_size(self) -> None:
        # A sequence's state is a fixed header plus a fixed size per position: measure both
        # once so STATE_META can report the exact size without a llama call.
        # (llama.cpp writes per-cell metadata, then per-layer rows: linear in the cell count.)
        # Sizes are those of the one-stream form blobs travel in (seqstate.py): a split
        # cache's own form has 4 bytes more per further stream and cache.
        seq = self.scratch_seq if self.kv_unified else 0  # slot 0 is empty until load ends
        tok = self.info.bos if self.info.bos >= 0 else 0
        self._decode_batch([(seq, tok, 0, False)], None)
        probe, _ = self._read_state(seq)
        # The sections this context's states hold: KV caches (iSWA: two), then a recurrent
        # or hybrid model's recurrent state, which has no streams (seqstate.py).
        recurrent = self.info.recurrent or self.info.hybrid
        n_kv = None if not recurrent else (2 if self.n_swa else 1) if self.info.hybrid else 0
        try:  # what a received state must match (None: a layout seqstate.py does not read)
            self._shape = learn_shape(probe, n_kv=n_kv, recurrent=recurrent)
            self.state_layout: StateLayout | None = read_layout(probe, self._shape)
        except StateLayoutError as exc:
            log.info("KV state layout not checked before restores (%s)", exc)
            self._shape, self.state_layout = MemoryShape(1), None
        n_kv_caches = self.state_layout.n_kv if self.state_layout else 1
        # K/V types and V transposition, read from a state llama.cpp wrote (what blobs carry).
        self.cache_layout = cache_layout(self.state_layout) if self.state_layout else {}
        self._stream_room = 4 * self.n_stream * n_kv_caches  # the local form's stream counts
        self._stream_overhead = 4 * (self.n_stream - 1) * n_kv_caches
        one = self.state_size(seq)
        one_swa = int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, seq, _PARTIAL))
        # What a context checkpoint of a recurrent or hybrid model holds: its recurrent
        # state, one per sequence, the same size at any position (None: no recurrent state).
        self.checkpoint_size = None if self.info.can_roll_back else one_swa
        self._decode_batch([(seq, tok, 1, False)], None)
        two = self.state_size(seq)
        two_swa = int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, seq, _PARTIAL))
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._state_base = self.state_size(seq)
        # A sliding-window model's state is its two caches': each linear in the cells it
        # writes, every position in the base cache, those in the window of the last one in
        # the SWA cache (llama.cpp writes no masked cell). The SWA cache alone is the partial
        # state: its size per cell apart from the base's.
        # (A memory with no SWA cache of its own writes its whole state as the partial one.)
        self._swa_per_cell = two_swa - one_swa if two_swa < two and self._swa_cells_computed() else 0
        self._state_per_pos = two - one - self._swa_per_cell
        # Header of a non-empty sequence.
        self._state_first = one - self._state_per_pos - self._swa_per_cell

    def _swa_cells_computed(self) -> bool:
        """Whether the slots' SWA cell counts (hence their exact state sizes) come from their
        positions (``_swa_cells``) rather than a llama.cpp size call, which walks every cell
        of both caches (34 us a call at one slot on Gemma 3, every slot of every step).
        Sliding-window models only, not recurrent or hybrid ones, whose window is the last
        n_swa positions."""
        if not self.n_swa or self.info.recurrent or self.info.hybrid:
            return False
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_model_meta_val_str(self._model, b"general.architecture", buf, len(buf))
        return n > 0 and buf.value not in _WINDOW_NOT_TRAILING

    def _swa_cells(self, slot: int, n_past: int) -> int:
        """The cells of the slot's SWA cache its state holds: its positions within the window
        of the last one (llama.cpp keeps a sequence's cells contiguous, from its lowest
        position to its highest, ``apply_ubatch``; the lowest is one cheap call), less any
        position below the window that has not been overwritten yet."""
        if n_past == 0:
            return 0
        low = int(llama_cpp.llama_memory_seq_pos_min(self._mem, slot))
        return n_past - max(low, n_past - self.n_swa)

    # ---- context checkpoints (checkpoints.py: the bookkeeping) -------------------------

    def _cut_needs_checkpoint(self, slot: int, n_keep: int) -> bool:
        """Whether the slot cut back to ``n_keep`` positions cannot be continued as it is: a
        recurrent state is one per sequence, at its last position; a window-sized SWA cache
        has dropped the cells before the cut its window needs."""
        n_held = len(self.seq_tokens[slot])
        if n_keep == 0 or n_keep >= n_held:
            return False
        return not self.info.can_roll_back or not window_holds(self.n_swa, n_held, self._swa_low[slot], n_keep)

    def reusable_prefix(self, slot: int, n_keep: int) -> int:
        """How much of a wanted prefix of ``n_keep`` positions the slot can really continue
        from: all of it, or, where the cut loses what continuing needs, its latest context
        checkpoint at or before the cut (0: none)."""
        if not self._cut_needs_checkpoint(slot, n_keep):
            return n_keep
        best = self.checkpoints.best(slot, n_keep)
        return best.n_tokens if best is not None else 0

    def reusable_in_state(self, n_tokens: int, n_keep: int, checkpoint_at: int | None = None) -> int:
        """``reusable_prefix`` for a saved state of ``n_tokens`` positions (the prompt
        cache's), with its context checkpoint at ``checkpoint_at`` positions (None: none)."""
        if not self.info.can_roll_back:  # whole, or but the last position (its logits may come along)
            whole = n_keep if n_keep >= n_tokens - 1 else 0
        else:
            whole = reusable_in_state(self.n_swa, n_tokens, n_keep)
        if whole or checkpoint_at is None or checkpoint_at > n_keep:
            return whole
        return checkpoint_at

    def take_checkpoint(self, slot: int) -> None:
        """Copy the part of the slot's state a cut cannot keep, as it is now: the SWA layers'
        cells, or the recurrent state (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, llama-server's)."""
        size = int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, slot, _PARTIAL))
        buf = (ctypes.c_uint8 * size)()
        if int(llama_cpp.llama_state_seq_get_data_ext(self._ctx, buf, size, slot, _PARTIAL)) != size:
            log.warning("context checkpoint of slot %d not taken: llama.cpp wrote a short state", slot)
            return
        n = len(self.seq_tokens[slot])
        self.checkpoints.add(slot, Checkpoint(n_tokens=n, swa_low=self._swa_low[slot], data=bytes(buf)))

    def _resume_from_checkpoint(self, slot: int, n_keep: int) -> bool:
        """Put back the partial state of the slot's checkpoint at ``n_keep`` (the other
        layers still hold every position up to it; the caller cuts them). False: there is
        none, or llama.cpp refused it (the caller empties the slot)."""
        best = self.checkpoints.best(slot, n_keep)
        if best is None or best.n_tokens != n_keep:
            return False
        src = (ctypes.c_uint8 * len(best.data)).from_buffer_copy(best.data)
        if int(llama_cpp.llama_state_seq_set_data_ext(self._ctx, src, len(best.data), slot, _PARTIAL)) != len(
            best.data
        ):
            return False
        self._swa_low[slot] = best.swa_low
        return True

    def slot_state_size(self, slot: int) -> int:
        """Exact serialized size of the slot's sequence, without a llama call (any thread)."""
        if not self.n_swa:
            return self.state_size_for(len(self.seq_tokens[slot]))
        if self._swa_per_cell:
            return self.state_size_for(len(self.seq_tokens[slot]), self._swa_n[slot])
        return self._sizes[slot]

    def state_size_for(self, n_past: int, n_swa_cells: int = 0) -> int:
        """The state size of a sequence of ``n_past`` positions (a sliding-window model's:
        with ``n_swa_cells`` of them in its SWA cache, ``_swa_cells``)."""
        if n_past == 0:
            return self._state_base
        return self._state_first + n_past * self._state_per_pos + n_swa_cells * self._swa_per_cell

    def state_size(self, slot: int) -> int:
        """The size of the slot's state in the one-stream form blobs travel in."""
        return int(llama_cpp.llama_state_seq_get_size(self._ctx, slot)) - self._stream_overhead

    def _read_state(self, seq: int) -> tuple[bytearray, list[int]]:
        """A sequence's state as llama.cpp writes it for this context, and its tokens."""
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, seq))
        buf = bytearray(size)
        cbuf = (ctypes.c_uint8 * size).from_buffer(buf)
        n = llama_cpp.llama_state_seq_get_data(self._ctx, cbuf, size, seq)
        del cbuf  # release the export so the bytearray can be resized/sliced freely
        if n != size:
            del buf[n:]
        return buf, list(self.seq_tokens[seq]) if seq < self.n_slots else []

    def snapshot(self, slot: int) -> Snapshot:
        """The slot's state as this context writes it (no rewrite: a restore into any slot
        here only moves its stream), with room before it for that move, then the slot's
        tail logits: for the prompt cache."""
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, slot))
        room = self._stream_room
        logits = self.tail_logits[slot]
        buf = bytearray(room + size + (len(logits) if logits is not None else 0))
        cbuf = (ctypes.c_uint8 * size).from_buffer(buf, room)
        n = llama_cpp.llama_state_seq_get_data(self._ctx, cbuf, size, slot)
        del cbuf
        if n != size:
            raise RuntimeError(f"llama.cpp wrote {n} of {size} state bytes")
        if logits is not None:
            buf[room + size :] = logits
        # KV caches only, in a layout seqstate.py reads: its first positions may be held apart.
        shape = self._shape if self.state_layout is not None and self._shape.recurrent is None else None
        tokens = list(self.seq_tokens[slot])
        checkpoint = self.checkpoints.best(slot, len(tokens) - 1)
        gap = None
        if checkpoint is not None and shape is not None:  # a window's: held as what the state lacks
            gap = window_gap(checkpoint.data, memoryview(buf)[room : room + size], shape)
            if gap is not None:  # its lowest position kept as its swa_low: what it holds, exactly
                checkpoint = Checkpoint(checkpoint.n_tokens, gap[1], gap[0])
        return Snapshot(
            tokens, buf, room, logits is not None, self.seq_salt[slot], self.seq_lora[slot], shape, checkpoint,
            gap is not None,
        )

    def checkpoint_of(self, snap: Snapshot, slot: int) -> Checkpoint | None:
        """A prompt cache entry's checkpoint as the slot resumes from it: made whole from the
        entry's state when it holds only what that lacks, in this context's streams."""
        checkpoint = snap.checkpoint
        if checkpoint is None or not snap.checkpoint_gap:
            return checkpoint
        assert snap.shape is not None
        try:
            view = memoryview(snap.buf)[snap.offset :]
            data = window_at(checkpoint.data, view, checkpoint.swa_low, checkpoint.n_tokens, snap.shape)
            local = with_streams(data, self.n_stream, 0 if self.kv_unified else slot, MemoryShape(1))
        except StateLayoutError as exc:
            log.warning("a prompt cache entry's checkpoint does not fit its state (%s): not kept", exc)
            return None
        return Checkpoint(checkpoint.n_tokens, checkpoint.swa_low, bytes(local))

    def state_get(self, slot: int) -> tuple[bytearray, list[int]]:
        """The slot's llama sequence state, in the one-stream form, and its tokens."""
        buf, tokens = self._read_state(slot)
        if self.n_stream > 1:  # compacted in place: the blob is held once
            with memoryview(buf) as view:
                one = rewrite_in_place(view, 0, 1, 0, self._shape)
                assert one is not None, "dropping streams needs no room"
                n = len(one)
                one.release()
            del buf[n:]
        return buf, tokens

    def _local_form(self, state: memoryview, seq: int, blob: memoryview | None) -> memoryview:
        """A received state (and what follows it) rewritten for this context's streams, the
        cells in ``seq``'s: in place where the blob's parsed head leaves room, else as a copy.
        What does not parse goes to llama.cpp as it is, to be refused."""
        stream = 0 if self.kv_unified else seq
        try:
            if blob is not None and not blob.readonly:
                local = rewrite_in_place(blob, len(blob) - len(state), self.n_stream, stream, self._shape)
                if local is not None:
                    return local
            return memoryview(with_streams(state, self.n_stream, stream, self._shape))
        except StateLayoutError:
            return state

    def _check_layout(self, state: memoryview, n_past: int) -> None:
        """Refuse, before any slot is touched, a state this context cannot take: one that
        does not parse, whose K/V types, row sizes or V transposition differ from the
        resident model's, that holds another position count than the blob declares, or
        whose trailing bytes are not exactly n_vocab logits."""
        if self.state_layout is None:
            return  # llama.cpp alone decides
        try:
            got = read_layout(state, self._shape)
        except StateLayoutError as exc:
            raise ProtocolError(ErrorCode.RESTORE_FAILED, f"not a KV state llama.cpp can restore: {exc}") from None
        why = layout_mismatch(got, self.state_layout)
        if why is not None:  # what was made elsewhere does not fit here: a capability, not damage
            raise ProtocolError(ErrorCode.CAP_MISMATCH, f"KV layout does not match this engine's: {why}")
        if got.n_past != n_past:
            raise ProtocolError(
                ErrorCode.RESTORE_FAILED, f"KV state holds {got.n_past} positions but the blob declares n_past={n_past}"
            )
        split_trailing_logits(state[got.end :], self.info.n_vocab)  # raises on another length

    def state_restore(
        self,
        slot: int,
        state: memoryview,
        tokens: Sequence[int],
        n_past: int,
        abort: threading.Event | None = None,
        *,
        blob: memoryview | None = None,
        salt: str | None = None,
        lora: LoraSet = (),
        checkpoint: BlobCheckpoint | Checkpoint | None = None,
    ) -> bool:
        """Restore a sequence state into ``slot``, all-or-nothing; its history is then
        ``salt``'s and the adapter set ``lora``'s (the request's that brought it: ``shared_prefix``). ``blob``: the
        whole blob ``state`` ends, whose bytes may be rewritten (seqstate.py) for this context's layout.

        Unified cache: the state lands in the scratch sequence first; only when llama.cpp
        accepted it, it holds exactly ``n_past`` positions, and what follows it is either
        nothing or exactly n_vocab f32 logits, does it replace the slot. Split cache: the same
        checks, in the slot's own stream, and any failure leaves the slot empty. The logits
        become the slot's ``tail_logits`` (a copy: a view would keep the whole received
        payload alive). ``checkpoint``: the blob's roll-back point of this history (a
        recurrent state at fewer positions, checked by the caller: engine/kv/copy.py; or a
        prompt cache entry's, ``Snapshot.checkpoint``), kept as the slot's context checkpoint.
        Returns whether the blob carried logits.
        """
        n_vocab = self.info.n_vocab
        if len(tokens) != n_past:
            raise ProtocolError(ErrorCode.RESTORE_FAILED, f"blob lists {len(tokens)} tokens for n_past={n_past}")
        if tokens and (min(tokens) < 0 or max(tokens) >= n_vocab):
            raise ProtocolError(
                ErrorCode.RESTORE_FAILED,
                f"blob holds token ids outside the resident vocabulary (0..{n_vocab - 1})",
            )
        if n_past > self.n_ctx_slot:
            raise ProtocolError(
                ErrorCode.RESTORE_FAILED, f"blob holds {n_past} positions; a slot holds at most {self.n_ctx_slot}"
            )
        self._check_layout(state, n_past)
        target = self.scratch_seq if self.kv_unified else slot
        if not self.kv_unified:
            self.clear_slot(slot)  # llama.cpp replaces the sequence: our record goes first
        local = self._local_form(state, target, blob)
        llama_cpp.llama_memory_seq_rm(self._mem, target, -1, -1)
        size = len(local)
        src = _as_ubyte_array(local)
        consumed = int(llama_cpp.llama_state_seq_set_data(self._ctx, src, size, target))
        if consumed == 0 and self.kv_unified and self.seq_tokens[slot] and self.pool_is_tight(n_past):
            # The shared pool had no room for a second copy: make room by dropping the slot's
            # current contents (the spec allows clearing on a failed restore) and try again.
            self.clear_slot(slot)
            consumed = int(llama_cpp.llama_state_seq_set_data(self._ctx, src, size, target))
        committed = False
        try:
            if consumed == 0:
                raise ProtocolError(
                    ErrorCode.RESTORE_FAILED,
                    "llama.cpp refused the KV state (layout does not match the resident model, "
                    "or the state is corrupt or truncated)",
                )
            restored = llama_cpp.llama_memory_seq_pos_max(self._mem, target) + 1
            if restored != n_past:
                raise ProtocolError(
                    ErrorCode.RESTORE_FAILED,
                    f"KV state holds {restored} positions but the blob declares n_past={n_past}",
                )
            logits = split_trailing_logits(local[consumed:], n_vocab)
            if abort is not None and abort.is_set():
                raise DecodeAborted
            if self.kv_unified:
                # Commit: in a unified KV cache seq_cp only tags cells, no bytes are copied.
                llama_cpp.llama_memory_seq_rm(self._mem, slot, -1, -1)
                llama_cpp.llama_memory_seq_cp(self._mem, target, slot, -1, -1)
            self.seq_tokens[slot] = list(tokens)
            self.seq_salt[slot], self.seq_lora[slot] = salt, lora
            # every position may differ (engine/kv/blocks.py keeps equal blocks)
            self._kept[slot] = 0
            # A state holds the SWA cells of its last window only.
            self._swa_low[slot] = max(0, n_past - self.n_swa)
            self.checkpoints.forget(slot)  # they were of the history this state replaces
            if checkpoint is not None and 0 < checkpoint.n_tokens < n_past:  # else no cut needs it
                n = checkpoint.n_tokens
                self.checkpoints.add(slot, Checkpoint(n, max(0, n - self.n_swa), bytes(checkpoint.data)))
            committed = True
            self._advanced(slot, bytes(logits) if logits is not None else None)
            return logits is not None
        finally:
            if self.kv_unified:
                llama_cpp.llama_memory_seq_rm(self._mem, target, -1, -1)
            elif not committed:
                llama_cpp.llama_memory_seq_rm(self._mem, slot, -1, -1)


def _as_ubyte_array(view: memoryview) -> ctypes.Array[ctypes.c_uint8]:
    """A ctypes view of a buffer without copying (read-only buffers are copied once)."""
    size = len(view)
    if view.readonly:
        return (ctypes.c_uint8 * size).from_buffer_copy(view)
    return (ctypes.c_uint8 * size).from_buffer(view)
