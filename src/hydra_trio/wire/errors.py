"""Typed protocol errors: every refusal carries a status and an error_code (spec §1 rule 3)."""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum, StrEnum
from typing import Any


class Status(IntEnum):
    OK = 0x00
    NOT_FOUND = 0x01
    ERROR = 0x02
    PARTIAL = 0x03  # never sent by an engine
    BUSY = 0x04
    BAD_REQUEST = 0x05
    NOT_IMPLEMENTED = 0x06


class ErrorCode(StrEnum):
    BAD_FRAME = "BAD_FRAME"
    BAD_KEY = "BAD_KEY"
    UNKNOWN_OP = "UNKNOWN_OP"
    TOO_LARGE = "TOO_LARGE"
    BAD_JSON = "BAD_JSON"
    HASH_MISMATCH = "HASH_MISMATCH"
    CAP_MISMATCH = "CAP_MISMATCH"
    SLOT_BUSY = "SLOT_BUSY"
    NO_SLOT = "NO_SLOT"
    RESTORE_FAILED = "RESTORE_FAILED"
    TIMEOUT = "TIMEOUT"
    RESULT_STORE_FULL = "RESULT_STORE_FULL"
    NOT_IMPLEMENTED = "NOT_IMPLEMENTED"
    INTERNAL = "INTERNAL"
    EXPORT_NOT_FOUND = "EXPORT_NOT_FOUND"  # ours: KV_PULL of an unknown, expired or pulled export


# The status a code is sent with unless the raiser says otherwise.
DEFAULT_STATUS: dict[ErrorCode, Status] = {
    ErrorCode.BAD_FRAME: Status.BAD_REQUEST,
    ErrorCode.BAD_KEY: Status.BAD_REQUEST,
    ErrorCode.UNKNOWN_OP: Status.ERROR,
    ErrorCode.TOO_LARGE: Status.BAD_REQUEST,
    ErrorCode.BAD_JSON: Status.ERROR,
    ErrorCode.HASH_MISMATCH: Status.BAD_REQUEST,
    ErrorCode.CAP_MISMATCH: Status.ERROR,
    ErrorCode.SLOT_BUSY: Status.BUSY,
    ErrorCode.NO_SLOT: Status.NOT_FOUND,
    ErrorCode.RESTORE_FAILED: Status.ERROR,
    ErrorCode.TIMEOUT: Status.ERROR,
    ErrorCode.RESULT_STORE_FULL: Status.BUSY,
    ErrorCode.NOT_IMPLEMENTED: Status.NOT_IMPLEMENTED,
    ErrorCode.INTERNAL: Status.ERROR,
    ErrorCode.EXPORT_NOT_FOUND: Status.NOT_FOUND,
}


class ProtocolError(Exception):
    """A refusal that becomes one well-formed non-OK response.

    ``extra`` holds op-specific meta fields (e.g. ``decode_request_id``) merged into the reply.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        status: Status | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status if status is not None else DEFAULT_STATUS[code]
        self.extra = dict(extra or {})

    def meta(self) -> dict[str, Any]:
        return {**self.extra, "error": self.message, "error_code": str(self.code)}

    def __repr__(self) -> str:
        return f"ProtocolError({self.status.name}, {self.code}, {self.message!r})"


class PromptTooLong(ProtocolError):
    """A prompt no slot can hold: TOO_LARGE on the wire; over HTTP the error agents act on
    (they compact the conversation): OpenAI's 400 ``context_length_exceeded``, Anthropic's
    400 ``invalid_request_error`` "prompt is too long"."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.TOO_LARGE, message, status=Status.BAD_REQUEST)


class ParamError(ProtocolError):
    """A refused request parameter: BAD_JSON / BAD_REQUEST, and ``param`` names it (OpenAI's
    ``error.param`` over HTTP; RPC replies carry the message as before)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(ErrorCode.BAD_JSON, message, status=Status.BAD_REQUEST)
        self.param = param

    def renamed(self, rename: Callable[[str], str]) -> ParamError:
        """This refusal with its parameter as another dialect spells it (the engine refuses
        in chat completions' names; a codec answers in its own)."""
        if self.param is None or (new := rename(self.param)) == self.param:
            return self
        return ParamError(self.message.replace(self.param, new), new)


def bad_param(message: str, param: str | None = None) -> ProtocolError:
    return ParamError(message, param)


class BadMagic(Exception):
    """The first two bytes are not the magic: the connection is closed without a reply."""
