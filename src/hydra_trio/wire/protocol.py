"""Request/response headers and opcodes of the RPC transport (spec §1, §2)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from .errors import BadMagic, ErrorCode, ProtocolError, Status
from .jsontext import parse_json_object

MAGIC = 0x4859
REQUEST_HEADER = struct.Struct("<HBBHQH")  # magic, op, flags, key_len, payload_len, trace_len
RESPONSE_HEADER = struct.Struct("<IQ")  # status | meta_len << 8 (u8 + u24), payload_len
assert REQUEST_HEADER.size == 16 and RESPONSE_HEADER.size == 12

MAX_META_LEN = (1 << 24) - 1


class Op(IntEnum):
    STATE_GET = 0x30
    STATE_PUT = 0x31
    STATE_META = 0x32
    CONFIGURE = 0x40
    INFO = 0x41
    PREFILL = 0x42
    DECODE = 0x43
    EXPERT_MODE = 0x44
    QUANT_SWAP = 0x45
    PIPELINE_ATTACH = 0x46
    KV_PULL = 0x47  # ours: pull a prefill engine's KV export (wire/kvpull.py)


@dataclass(frozen=True, slots=True)
class RequestHeader:
    op: int
    flags: int
    key_len: int
    payload_len: int
    trace_len: int

    @property
    def body_len(self) -> int:
        return self.key_len + self.trace_len + self.payload_len


def parse_request_header(data: bytes | bytearray | memoryview) -> RequestHeader:
    """Parse the 16-byte request header. Raises BadMagic on wrong magic."""
    if len(data) != REQUEST_HEADER.size:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"request header must be {REQUEST_HEADER.size} bytes")
    magic, op, flags, key_len, payload_len, trace_len = REQUEST_HEADER.unpack(data)
    if magic != MAGIC:
        raise BadMagic(f"bad magic 0x{magic:04x}")
    return RequestHeader(op, flags, key_len, payload_len, trace_len)


def encode_request_header(
    op: int, *, key_len: int, payload_len: int, trace_len: int = 0, flags: int = 0
) -> bytes:
    return REQUEST_HEADER.pack(MAGIC, op, flags, key_len, payload_len, trace_len)


def encode_request(op: int, key: bytes = b"", payload: bytes = b"", trace: bytes = b"") -> bytes:
    """One whole request as bytes (convenient for small payloads and tests)."""
    head = encode_request_header(op, key_len=len(key), payload_len=len(payload), trace_len=len(trace))
    return b"".join((head, key, trace, payload))


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    status: int
    meta_len: int
    payload_len: int


def encode_response_header(status: int, meta_len: int, payload_len: int) -> bytes:
    if not 0 <= meta_len <= MAX_META_LEN:
        raise ValueError(f"meta too large: {meta_len} bytes")
    return RESPONSE_HEADER.pack((status & 0xFF) | (meta_len << 8), payload_len)


def parse_response_header(data: bytes | bytearray | memoryview) -> ResponseHeader:
    if len(data) != RESPONSE_HEADER.size:
        raise ProtocolError(ErrorCode.BAD_FRAME, "response header must be 12 bytes")
    word, payload_len = RESPONSE_HEADER.unpack(data)
    return ResponseHeader(word & 0xFF, word >> 8, payload_len)


def encode_meta(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()


def encode_response(status: int, meta: dict[str, Any], payload_len: int = 0) -> bytes:
    """Header + meta; the caller sends ``payload_len`` payload bytes after it."""
    meta_bytes = encode_meta(meta)
    return encode_response_header(status, len(meta_bytes), payload_len) + meta_bytes


def error_response(err: ProtocolError) -> bytes:
    return encode_response(err.status, err.meta())


_ASCII_DIGITS = frozenset(b"0123456789")


def ascii_decimal(raw: str | bytes, *, max_digits: int = 9) -> int | None:
    """``raw`` as a non-negative integer when it is 1..``max_digits`` ASCII digits, else None.
    str.isdigit() and int() take Unicode digits ('²', '١'), spaces, signs and underscores:
    every id on the wire and in a URL path goes through this one check instead."""
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
    if not 0 < len(data) <= max_digits or not _ASCII_DIGITS.issuperset(data):
        return None
    return int(data)


def parse_slot_key(key: bytes, *, empty_means_zero: bool = False) -> int:
    """A slot key is ASCII decimal; INFO and CONFIGURE accept an empty key as slot 0."""
    if not key:
        if empty_means_zero:
            return 0
        raise ProtocolError(ErrorCode.BAD_KEY, "empty key: a slot id in ASCII decimal is required")
    slot = ascii_decimal(key)
    if slot is None:
        raise ProtocolError(ErrorCode.BAD_KEY, f"key must be a slot id in ASCII decimal, got {key[:32]!r}")
    return slot


def decode_json_object(payload: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    """An op's JSON object payload (``parse_json_object``'s rule); an empty payload is ``{}``."""
    return parse_json_object(payload, what) if len(payload) else {}


__all__ = [
    "MAGIC",
    "REQUEST_HEADER",
    "RESPONSE_HEADER",
    "Op",
    "RequestHeader",
    "ResponseHeader",
    "Status",
    "ascii_decimal",
    "decode_json_object",
    "encode_meta",
    "encode_request",
    "encode_request_header",
    "encode_response",
    "encode_response_header",
    "error_response",
    "parse_request_header",
    "parse_response_header",
    "parse_slot_key",
]
