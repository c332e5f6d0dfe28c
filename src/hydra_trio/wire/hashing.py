"""Seedless XXH3-64 and the ``"xxh3:<16 hex>"`` tags of the wire protocol (spec §2, §4.1).

Every function takes any C-contiguous buffer (bytes, bytearray, memoryview) and hashes it in
place: a multi-GB KV view is never copied to be hashed.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from .errors import ErrorCode, ProtocolError

Buffer = bytes | bytearray | memoryview

TAG_PREFIX = "xxh3:"
_TAG_LEN = len(TAG_PREFIX) + 16
_HEX = frozenset("0123456789abcdefABCDEF")


def xxh3_64(data: Buffer) -> int:
    """Seedless XXH3-64 as an unsigned int (what ``xxhash.xxh3_64_intdigest`` returns)."""
    return xxhash.xxh3_64_intdigest(data)


def format_tag(value: int) -> str:
    return f"{TAG_PREFIX}{value:016x}"


def xxh3_tag(data: Buffer) -> str:
    """``"xxh3:<16 lowercase hex, zero padded>"`` of ``data``."""
    return format_tag(xxh3_64(data))


def xxh3_tag_of(parts: Iterable[Buffer]) -> str:
    """The tag of the parts' concatenation, hashed part by part (a blob kept as head and
    state is never joined to be hashed)."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return format_tag(h.intdigest())


def parse_tag(tag: object, what: str = "hash") -> int | None:
    """The integer a tag names; None for ``""``/None (= not checked).

    Anything else that is not ``xxh3:`` + exactly 16 hex digits is BAD_FRAME. Upper-case hex is
    accepted (we emit lower case; being lenient on input costs nothing).
    """
    if tag is None or tag == "":
        return None
    if (
        not isinstance(tag, str)
        or len(tag) != _TAG_LEN
        or not tag.startswith(TAG_PREFIX)
        or not _HEX.issuperset(tag[len(TAG_PREFIX) :])
    ):
        shown = tag[:40] if isinstance(tag, str) else type(tag).__name__
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"{what}: malformed hash {shown!r} (expected '{TAG_PREFIX}<16 hex>')"
        )
    return int(tag[len(TAG_PREFIX) :], 16)


def check_tag(data: Buffer, tag: object, what: str, *, digest: int | None = None) -> None:
    """Verify ``data`` against ``tag``; ``""``/None means "not checked". ``digest``: the XXH3
    of these very bytes when the caller already computed it (e.g. as they arrived).

    Raises ProtocolError: BAD_FRAME for a malformed tag, HASH_MISMATCH when the bytes differ.
    """
    expected = parse_tag(tag, what)
    if expected is None:
        return
    actual = xxh3_64(data) if digest is None else digest
    if actual != expected:
        raise ProtocolError(
            ErrorCode.HASH_MISMATCH,
            f"{what}: hash mismatch (declared {format_tag(expected)}, got {format_tag(actual)})",
        )


__all__ = ["TAG_PREFIX", "check_tag", "format_tag", "parse_tag", "xxh3_64", "xxh3_tag", "xxh3_tag_of"]
