"""DECODE (op 0x43) payload frames, spec §4.1: v3 and the simple frame.

v3:     ``[u32 hdr_len][u64 xxh3_64(header)][header JSON][prompt segment][kv segment]``
simple: ``[u32 json_len][JSON (prompt under "prompt")][raw KV blob]``

Parsing is zero-copy: ``DecodeFrame.kv`` is a view into the caller's buffer, so a multi-GB
KV segment is held in memory once. Every refusal is a ``ProtocolError``, whatever the bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Literal

from . import sampling
from .errors import ErrorCode, ProtocolError
from .hashing import check_tag, format_tag, parse_tag, xxh3_64, xxh3_tag
from .jsontext import parse_json, parse_json_object

Buffer = bytes | bytearray | memoryview

DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_MAX_PROMPT_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_KV_BYTES = 4 * 1024**3

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_V3_PREFIX = struct.Struct("<IQ")  # hdr_len, xxh3_64(header)
_OPEN_BRACE = ord("{")
_SEGMENT_IDS = ("prompt", "kv")


@dataclass(frozen=True, slots=True)
class DecodeFrame:
    """One parsed DECODE payload.

    ``request`` is the prompt object (messages/prompt, n_predict, sampling keys, stop, ...):
    always a dict, ``{}`` when there is none. ``kv`` is a zero-copy view of the KV blob (empty
    when the frame carries none). ``kv_hash`` is the verified, lower-cased ``"xxh3:..."`` tag
    of the kv segment when the sender gave one (v3 only), else None.
    """

    kind: Literal["v3", "simple"]
    header: dict[str, Any]
    request: dict[str, Any]
    kv: memoryview
    kv_hash: str | None


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FRAME, f"decode frame: {msg}")


def _too_large(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.TOO_LARGE, f"decode frame: {msg}")


def _show(value: Any) -> str:
    """A short rendering of a JSON value for messages. Containers are named, not repr'd: a
    deeply nested value that json accepted could still blow the recursion limit in repr."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)[:40]
    return type(value).__name__


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")  # TypeError for a non-contiguous buffer: a caller bug, not bytes
    return view


def _as_request(value: Any, what: str, *, allow_str: bool) -> dict[str, Any]:
    """A prompt value as the request object: object as is, array = messages, string = prompt.

    A v3 prompt segment must be an object or an array (spec §4.1); the simple frame's
    ``"prompt"`` may also be a plain string, and null there means "absent".
    """
    if isinstance(value, dict):
        return value
    if isinstance(value, list):
        return {"messages": value}
    if allow_str and isinstance(value, str):
        return {"prompt": value}
    if allow_str and value is None:
        return {}
    expected = "an object, a messages array or a string" if allow_str else "an object or an array"
    raise ProtocolError(
        ErrorCode.BAD_JSON, f"{what}: expected {expected}, got {type(value).__name__}"
    )


def parse_decode_frame(
    payload: Buffer,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
    kv_digest: int | None = None,
) -> DecodeFrame:
    """Split and verify a DECODE payload. Raises ProtocolError only.

    ``kv_digest``: the XXH3 of the kv segment, when the caller hashed it as it arrived (see
    ``v3_kv_span``); the segment is then not hashed again.

    Order (spec §4.2: frame and caps -> hashes -> JSON), applied layer by layer because the
    segment table lives *inside* the header and cannot be read before the header is verified:
      1. outer frame: u32 length, header cap (TOO_LARGE), truncation (BAD_FRAME);
      2. header hash (HASH_MISMATCH) -- nothing read from an unverified header decides a verdict;
      3. header JSON (BAD_JSON), ``"v": 3`` (BAD_FRAME);
      4. segment table (BAD_FRAME) and prompt/kv caps (TOO_LARGE) -- before any segment is
         hashed, so an oversized KV is refused without hashing gigabytes;
      5. prompt hash, then kv hash (HASH_MISMATCH; a malformed tag was BAD_FRAME in step 4);
      6. prompt JSON (BAD_JSON).
    """
    view = _byte_view(payload)
    total = len(view)
    if total < 4:
        raise _bad(f"{total} bytes, need at least the u32 header length")
    (hdr_len,) = _U32.unpack_from(view, 0)
    if hdr_len > max_header_bytes:
        # Too long for a v3 header; a simple frame's JSON also carries the prompt, so it may
        # be as long as a header plus a prompt.
        simple_cap = max_header_bytes + max_prompt_bytes
        if total > 4 and view[4] == _OPEN_BRACE and hdr_len <= simple_cap:
            return _parse_simple(view, hdr_len, max_kv_bytes=max_kv_bytes)
        raise _too_large(f"header is {hdr_len} bytes, cap is {max_header_bytes} ({simple_cap} for a simple frame)")

    # Telling the kinds apart (spec §4.1), in this order:
    #   * v3 when the 8 bytes after the length equal xxh3_64 of the hdr_len bytes after them;
    #   * else simple when the byte right after the length is '{';
    #   * else neither: only a damaged v3 frame looks like that (a simple frame always has '{'
    #     there), so it is refused as v3 -- truncated: BAD_FRAME, otherwise HASH_MISMATCH.
    # Hence every intact v3 frame reads as v3, and an intact simple frame could be misread only
    # if its first 8 JSON bytes equal a 64-bit hash (2^-64). The price: a v3 frame with a bad
    # header hash whose first stored byte happens to be 0x7b ('{', 1 in 256) reads as simple and
    # is refused as a simple frame (in practice BAD_JSON) rather than HASH_MISMATCH. Still a
    # refusal, and the spec's rule offers nothing to tell the two apart.
    header_end = 12 + hdr_len
    stored: int | None = None
    actual: int | None = None
    if total >= header_end:
        header_bytes = view[12:header_end]
        (stored,) = _U64.unpack_from(view, 4)
        actual = xxh3_64(header_bytes)
        if actual == stored:
            return _parse_v3(
                view,
                header_bytes,
                header_end,
                max_prompt_bytes=max_prompt_bytes,
                max_kv_bytes=max_kv_bytes,
                kv_digest=kv_digest,
            )
    if total > 4 and view[4] == _OPEN_BRACE:
        return _parse_simple(view, hdr_len, max_kv_bytes=max_kv_bytes)
    if stored is None or actual is None:
        raise _bad(f"truncated: header declares {hdr_len} bytes, {max(total - 12, 0)} present")
    raise ProtocolError(
        ErrorCode.HASH_MISMATCH,
        f"decode frame: header hash mismatch (declared {format_tag(stored)}, "
        f"got {format_tag(actual)})",
    )


def v3_kv_span(
    head: Buffer, payload_len: int, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
) -> tuple[int, int] | None:
    """Where the kv segment of a v3 DECODE payload lies, from its first bytes alone: the
    u32 length, the header hash and the header. ``(start, length)`` within the payload when
    the header is intact and names a kv hash to check; None otherwise (too few bytes yet, a
    simple frame, or anything the full parse will refuse or not hash).

    Lets a receiver hash the kv segment as it arrives; ``parse_decode_frame(kv_digest=...)``
    then checks that digest and every rule as usual."""
    view = _byte_view(head)
    if len(view) < 12:
        return None
    (hdr_len,) = _U32.unpack_from(view, 0)
    header_end = 12 + hdr_len
    if hdr_len > max_header_bytes or len(view) < header_end or payload_len < header_end:
        return None
    header_bytes = view[12:header_end]
    if xxh3_64(header_bytes) != _U64.unpack_from(view, 4)[0]:
        return None
    try:
        header = parse_json_object(header_bytes, "decode header")
        segments = _segment_table(header.get("segments"), payload_len - header_end)
        k_off, k_len, k_tag = segments.get("kv", (0, 0, None))
        if not k_len or parse_tag(k_tag) is None:
            return None
    except ProtocolError:
        return None
    return header_end + k_off, k_len


def v3_head_len(first4: Buffer) -> int:
    """How many leading bytes ``v3_kv_span`` needs: the 12-byte prefix plus the header whose
    length the first 4 bytes declare."""
    return 12 + _U32.unpack_from(_byte_view(first4), 0)[0]


def _parse_simple(view: memoryview, json_len: int, *, max_kv_bytes: int) -> DecodeFrame:
    json_end = 4 + json_len
    if len(view) < json_end:
        raise _bad(f"truncated: header declares {json_len} bytes, {len(view) - 4} present")
    kv = view[json_end:]
    if len(kv) > max_kv_bytes:
        raise _too_large(f"kv blob is {len(kv)} bytes, cap is {max_kv_bytes}")
    header = parse_json_object(view[4:json_end], "decode header")
    request = _as_request(header.get("prompt"), "decode header prompt", allow_str=True)
    return DecodeFrame("simple", header, request, kv, None)


def _segment_table(raw: Any, body_len: int) -> dict[str, tuple[int, int, Any]]:
    """Validate the v3 segment table; returns id -> (offset, len, hash tag)."""
    if raw is None:
        raw = []  # no table: valid only for a frame with nothing after the header
    if not isinstance(raw, list):
        raise _bad(f"segments must be an array, got {type(raw).__name__}")
    found: dict[str, tuple[int, int, Any]] = {}
    for entry in raw:
        if not isinstance(entry, dict):
            raise _bad(f"segment entries must be objects, got {type(entry).__name__}")
        sid = entry.get("id")
        if not isinstance(sid, str) or sid not in _SEGMENT_IDS:
            raise _bad(f"unknown segment id {_show(sid)}")
        if sid in found:
            raise _bad(f"duplicate {sid} segment")
        offset, length = entry.get("offset"), entry.get("len")
        for name, value in (("offset", offset), ("len", length)):
            # type() check: bool is an int subclass and must not pass as 0/1.
            if type(value) is not int or value < 0:
                raise _bad(
                    f"{sid} segment {name} must be a non-negative integer, got {_show(value)}"
                )
        tag = entry.get("hash")
        parse_tag(tag, f"decode frame: {sid} segment")  # malformed tag: BAD_FRAME, before hashing
        found[sid] = (offset, length, tag)
    # Contiguous from 0 in offset order (zero-length segments first on ties), no gaps/overlaps.
    pos = 0
    for sid, (offset, length, _) in sorted(found.items(), key=lambda item: item[1][:2]):
        if offset != pos:
            raise _bad(f"{sid} segment at offset {offset}, expected {pos} (not contiguous)")
        pos += length
    if pos != body_len:
        raise _bad(f"segments cover {pos} bytes, the frame holds {body_len} after the header")
    return found


def _parse_v3(
    view: memoryview,
    header_bytes: memoryview,
    header_end: int,
    *,
    max_prompt_bytes: int,
    max_kv_bytes: int,
    kv_digest: int | None = None,
) -> DecodeFrame:
    header = parse_json_object(header_bytes, "decode header")
    version = header.get("v")
    if type(version) is not int or version != 3:
        raise _bad(f'header "v" must be 3, got {_show(version)}')
    body = view[header_end:]
    segments = _segment_table(header.get("segments"), len(body))
    p_off, p_len, p_tag = segments.get("prompt", (0, 0, None))
    k_off, k_len, k_tag = segments.get("kv", (0, 0, None))
    if p_len > max_prompt_bytes:
        raise _too_large(f"prompt segment is {p_len} bytes, cap is {max_prompt_bytes}")
    if k_len > max_kv_bytes:
        raise _too_large(f"kv segment is {k_len} bytes, cap is {max_kv_bytes}")
    prompt = body[p_off : p_off + p_len]
    kv = body[k_off : k_off + k_len]
    check_tag(prompt, p_tag, "decode frame: prompt segment")
    check_tag(kv, k_tag, "decode frame: kv segment", digest=kv_digest)
    request: dict[str, Any] = {}
    if p_len:
        request = _as_request(parse_json(prompt, "prompt segment"), "prompt segment", allow_str=False)
    kv_tag = parse_tag(k_tag)
    return DecodeFrame("v3", header, request, kv, None if kv_tag is None else format_tag(kv_tag))


def merged_generation(frame: DecodeFrame) -> dict[str, Any]:
    """The effective generation parameters of a DECODE: one flat dict.

    Layers, later wins: ``header["generation"]`` (ignored unless an object), then the request
    (prompt segment / simple-frame prompt: "keys in the prompt segment win", spec §4.1), by
    the one rule of wire/sampling.py (a layer's ``"sampling"`` object beats its top-level
    keys; aliases renamed). Inputs are not mutated.
    """
    generation = frame.header.get("generation")
    return sampling.merge(generation if isinstance(generation, dict) else {}, frame.request)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def encode_v3_raw(header_json: Buffer, body: Buffer, *, header_hash: int | None = None) -> bytes:
    """Low-level v3 assembly from raw header bytes (tests, hand-made frames).

    ``header_hash`` defaults to the correct xxh3 of ``header_json``.
    """
    digest = xxh3_64(header_json) if header_hash is None else header_hash
    return b"".join((_V3_PREFIX.pack(len(header_json), digest), header_json, body))


def encode_decode_frame_v3(
    header: dict[str, Any],
    request: dict[str, Any] | list[Any] | Buffer | None,
    kv: Buffer,
    *,
    hash_segments: bool = True,
) -> bytes:
    """A valid v3 frame. ``"v"`` and ``"segments"`` are set (other header keys kept, in order).

    ``request``: an object or messages array (JSON-encoded compactly), raw bytes sent as is, or
    None for an empty prompt segment. With ``hash_segments``, non-empty segments get their
    ``xxh3:`` tag; empty ones (and all, without it) get ``""`` (not checked).
    """
    if request is None:
        prompt: Buffer = b""
    elif isinstance(request, bytes | bytearray | memoryview):
        prompt = _byte_view(request)
    else:
        prompt = _dumps(request)
    kv_view = _byte_view(kv)

    def tag(data: Buffer) -> str:
        return xxh3_tag(data) if hash_segments and len(data) else ""

    head = dict(header)
    head["v"] = 3
    head["segments"] = [
        {"id": "prompt", "offset": 0, "len": len(prompt), "hash": tag(prompt)},
        {"id": "kv", "offset": len(prompt), "len": len(kv_view), "hash": tag(kv_view)},
    ]
    header_json = _dumps(head)
    return b"".join(
        (_V3_PREFIX.pack(len(header_json), xxh3_64(header_json)), header_json, prompt, kv_view)
    )


def encode_decode_frame_simple(header: dict[str, Any], kv: Buffer) -> bytes:
    """A simple frame: ``header`` (carrying ``"prompt"``) as compact JSON, then the raw blob."""
    header_json = _dumps(header)
    return b"".join((_U32.pack(len(header_json)), header_json, _byte_view(kv)))


__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_KV_BYTES",
    "DEFAULT_MAX_PROMPT_BYTES",
    "DecodeFrame",
    "encode_decode_frame_simple",
    "encode_decode_frame_v3",
    "encode_v3_raw",
    "merged_generation",
    "parse_decode_frame",
    "v3_head_len",
    "v3_kv_span",
]
