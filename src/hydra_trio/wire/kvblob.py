"""The KV blob (spec §3): slot tokens + llama sequence state (+ logits after PREFILL).

Read: version 0x02, version 0x03 (the C++ engine's STATE_GET today: v2 except that the
checkpoint section may be a recurrent-only capture, flag 0x02) and the legacy unversioned
blob, which is llama.cpp's sequence-state file (``llama_state_seq_save_file``): u32 magic
``ggsq`` at offset 0, u32 file version, u32 n_tok, tokens, state. The first byte decides, and
cannot be mistaken: a versioned blob starts 0x02 or 0x03, the legacy one with the magic's
first byte 0x71 ('q', little-endian). Written: always v2, which every reader takes.

Parsing is zero-copy: the returned views point into the caller's buffer, so a multi-GB blob
is held in memory once.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass

from .errors import ErrorCode, ProtocolError

KV_BLOB_VERSION = 0x02  # what this engine writes
KV_BLOB_V3 = 0x03
READ_VERSIONS = (KV_BLOB_VERSION, KV_BLOB_V3)
FLAG_CHECKPOINT = 0x01
FLAG_RECURRENT_ONLY = 0x02  # v3: the checkpoint holds the recurrent state alone
# The legacy blob: llama.cpp's LLAMA_STATE_SEQ_MAGIC ('ggsq') as a little-endian u32.
LEGACY_MAGIC = 0x67677371
LEGACY_FILE_VERSIONS = (2, 3)  # LLAMA_STATE_SEQ_VERSION of the llama.cpp builds that wrote them
_LEGACY_HEAD = struct.Struct("<III")  # magic, file version, n_tok
_HEAD = struct.Struct("<BII")  # version, n_past, n_tok
_CKPT_HEAD = struct.Struct("<iiqQ")  # pos_min, pos_max, n_tokens, size
_U64 = struct.Struct("<Q")
_MAX_TOKENS = 1 << 24  # far above any context length; bounds allocation on hostile input

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Recurrent-state checkpoint (recurrent/hybrid models only)."""

    pos_min: int
    pos_max: int
    n_tokens: int
    data: memoryview
    draft: memoryview
    recurrent_only: bool = False  # v3 flag 0x02: a capture of the recurrent state alone


@dataclass(frozen=True, slots=True)
class KvBlob:
    n_past: int
    tokens: list[int]
    # The llama sequence state, possibly followed by n_vocab f32 logits. Only llama.cpp knows
    # where its state ends, so the restore splits the two (see split_trailing_logits).
    state: memoryview
    checkpoint: Checkpoint | None = None
    # The whole blob (``state`` is its end). Once parsed, the bytes before ``state`` hold
    # nothing anyone reads again: a restore may rewrite the state into them (seqstate.py).
    raw: memoryview | None = None
    version: int = KV_BLOB_VERSION  # 0x02, 0x03, or 0 for the legacy unversioned blob

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FRAME, f"kv blob: {msg}")


def _tokens_to_bytes(tokens: list[int] | array) -> bytes:
    arr = array("i", tokens)
    if sys.byteorder == "big":  # wire is little-endian
        arr.byteswap()
    return arr.tobytes()


def blob_head_size(n_tokens: int) -> int:
    """Bytes of ``encode_blob_head`` for ``n_tokens`` tokens without a checkpoint: to charge
    a blob to a budget before it is made."""
    return _HEAD.size + 4 * n_tokens + 1  # + the flags byte


def encode_blob_head(
    n_past: int, tokens: list[int] | array, checkpoint: Checkpoint | None = None, *, version: int = KV_BLOB_VERSION
) -> bytes:
    """Everything before the llama state bytes. Send it, then the state, then optional logits.
    ``version``: 0x03 only to build what the C++ engine sends (tests); this engine sends v2."""
    if version not in READ_VERSIONS:
        raise ValueError(f"kv blob version 0x{version:02x}")
    parts = [_HEAD.pack(version, n_past, len(tokens)), _tokens_to_bytes(tokens)]
    if checkpoint is None:
        parts.append(b"\x00")
    else:
        if checkpoint.recurrent_only and version != KV_BLOB_V3:
            raise ValueError("a recurrent-only checkpoint needs a v3 blob")
        parts.append(bytes([FLAG_CHECKPOINT | (FLAG_RECURRENT_ONLY if checkpoint.recurrent_only else 0)]))
        parts.append(
            _CKPT_HEAD.pack(checkpoint.pos_min, checkpoint.pos_max, checkpoint.n_tokens, len(checkpoint.data))
        )
        parts.append(bytes(checkpoint.data))
        parts.append(_U64.pack(len(checkpoint.draft)))
        parts.append(bytes(checkpoint.draft))
    return b"".join(parts)


def encode_kv_blob(
    n_past: int,
    tokens: list[int] | array,
    state: Buffer,
    logits: Buffer | None = None,
    checkpoint: Checkpoint | None = None,
    *,
    version: int = KV_BLOB_VERSION,
) -> bytes:
    parts = [encode_blob_head(n_past, tokens, checkpoint, version=version), state]
    if logits is not None:
        parts.append(logits)
    return b"".join(parts)


def encode_legacy_blob(tokens: list[int] | array, state: Buffer, *, file_version: int = 2) -> bytes:
    """The legacy unversioned blob (llama.cpp's sequence-state file layout): for tests and
    tools; this engine never sends one."""
    return b"".join([_LEGACY_HEAD.pack(LEGACY_MAGIC, file_version, len(tokens)), _tokens_to_bytes(tokens), state])


def _read_tokens(view: memoryview, pos: int, n_tok: int, max_tokens: int) -> tuple[list[int], int]:
    if n_tok > min(max_tokens, _MAX_TOKENS):
        raise _bad(f"declares {n_tok} tokens; a slot holds at most {min(max_tokens, _MAX_TOKENS)}")
    end_tokens = pos + 4 * n_tok
    if end_tokens > len(view):
        raise _bad(f"declares {n_tok} tokens but holds only {len(view) - pos} bytes after the head")
    arr = array("i")
    arr.frombytes(view[pos:end_tokens])
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist(), end_tokens


def _parse_legacy(view: memoryview, max_tokens: int) -> KvBlob:
    if len(view) < _LEGACY_HEAD.size:
        raise _bad(f"legacy blob too short ({len(view)} bytes)")
    _magic, file_version, n_tok = _LEGACY_HEAD.unpack_from(view, 0)
    if file_version not in LEGACY_FILE_VERSIONS:
        raise _bad(f"legacy (ggsq) blob of file version {file_version}; known: {list(LEGACY_FILE_VERSIONS)}")
    tokens, pos = _read_tokens(view, _LEGACY_HEAD.size, n_tok, max_tokens)
    state = view[pos:]
    if len(state) == 0:
        raise _bad("no KV state bytes")
    # A sequence file holds exactly its tokens' positions: n_past is their count.
    return KvBlob(n_past=n_tok, tokens=tokens, state=state, raw=view, version=0)


def parse_kv_blob(buf: Buffer, *, max_tokens: int = _MAX_TOKENS) -> KvBlob:
    """Check the blob's structure; raise ProtocolError(BAD_FRAME) on anything that does not fit.

    ``max_tokens``: the most tokens a slot can hold (the engine passes its n_ctx). A larger
    declared count is refused before the token list is built (up to 2^24 Python ints, ~0.5 GB,
    otherwise)."""
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    if len(view) >= 4 and int.from_bytes(view[:4], "little") == LEGACY_MAGIC:
        return _parse_legacy(view, max_tokens)
    if len(view) < _HEAD.size + 1:
        raise _bad(f"too short ({len(view)} bytes)")
    version, n_past, n_tok = _HEAD.unpack_from(view, 0)
    if version not in READ_VERSIONS:
        raise _bad(f"unsupported version 0x{version:02x} (known: 0x02, 0x03, and the legacy ggsq blob)")
    tokens, pos = _read_tokens(view, _HEAD.size, n_tok, max_tokens)
    if pos + 1 > len(view):
        raise _bad(f"declares {n_tok} tokens but holds only {len(view) - _HEAD.size} bytes after the head")
    flags = view[pos]
    pos += 1
    known = FLAG_CHECKPOINT | (FLAG_RECURRENT_ONLY if version == KV_BLOB_V3 else 0)
    if flags & ~known:
        raise _bad(f"unknown flag bits 0x{flags:02x} for version 0x{version:02x}")
    if flags & FLAG_RECURRENT_ONLY and not flags & FLAG_CHECKPOINT:
        raise _bad("flag 0x02 (recurrent-only checkpoint) without a checkpoint (flag 0x01)")
    checkpoint = None
    if flags & FLAG_CHECKPOINT:
        if pos + _CKPT_HEAD.size > len(view):
            raise _bad("checkpoint header truncated")
        pos_min, pos_max, ck_tokens, size = _CKPT_HEAD.unpack_from(view, pos)
        pos += _CKPT_HEAD.size
        if size > len(view) - pos:
            raise _bad(f"checkpoint declares {size} bytes, {len(view) - pos} remain")
        data = view[pos : pos + size]
        pos += size
        if pos + _U64.size > len(view):
            raise _bad("checkpoint draft size truncated")
        (draft_size,) = _U64.unpack_from(view, pos)
        pos += _U64.size
        if draft_size > len(view) - pos:
            raise _bad(f"checkpoint draft declares {draft_size} bytes, {len(view) - pos} remain")
        draft = view[pos : pos + draft_size]
        pos += draft_size
        checkpoint = Checkpoint(pos_min, pos_max, ck_tokens, data, draft, bool(flags & FLAG_RECURRENT_ONLY))
    state = view[pos:]
    if len(state) == 0:
        raise _bad("no KV state bytes")
    return KvBlob(n_past=n_past, tokens=tokens, state=state, checkpoint=checkpoint, raw=view, version=version)


def split_trailing_logits(tail: memoryview, n_vocab: int) -> memoryview | None:
    """Bytes left after llama.cpp consumed its state: logits iff exactly n_vocab f32 values.

    Returns the logits view, None when there is no tail; raises on any other length.
    """
    if len(tail) == 0:
        return None
    if len(tail) == 4 * n_vocab:
        return tail
    raise ProtocolError(
        ErrorCode.RESTORE_FAILED,
        f"kv blob: {len(tail)} trailing bytes after the KV state; logits would be {4 * n_vocab}",
    )
