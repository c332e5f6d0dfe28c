"""Strict JSON text: the one rule for every JSON that comes in (HTTP bodies, RPC payloads and
reply metas, DECODE frames, KV_PULL requests).

UTF-8 without a byte-order mark (RFC 8259 §8.1), and numbers only: ``NaN``, ``Infinity`` and a
number past a float's range (``1e999``, which Python would read as inf) are refused. None of
them is JSON, and none could be written back out as JSON (an error reply or a log line that
echoes a value, a kv_transfer_params passed on). What a client's JSON library writes
(OpenAI's SDKs: httpx ``allow_nan=False``, JavaScript's ``JSON.stringify``) is always finite.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import ErrorCode, ProtocolError

Buffer = bytes | bytearray | memoryview


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_json(data: Buffer, what: str) -> Any:
    """Any strict JSON value; every failure is BAD_JSON, its message naming ``what``."""
    try:
        # str() of the buffer is the one copy json needs (bytes() then decode would be two).
        return json.loads(str(data, "utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad UTF-8, bad syntax, the constants above, an integer past Python's
        # 4,300-digit conversion limit; RecursionError: nesting past the parser's depth.
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what}: invalid JSON: {exc}") from None


def parse_json_object(data: Buffer, what: str) -> dict[str, Any]:
    """A strict JSON object (``parse_json``); any other value is BAD_JSON."""
    value = parse_json(data, what)
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


__all__ = ["parse_json", "parse_json_object"]
