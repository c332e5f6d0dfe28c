"""How protocol errors map to HTTP statuses: the caller's faults are 4xx, the engine's 5xx."""

from __future__ import annotations

import pytest

from hydra_trio.http.common import http_status
from hydra_trio.wire.errors import ErrorCode, ProtocolError, Status


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        (ErrorCode.RESTORE_FAILED, None, 422),  # the blob's contents, refused for this model
        (ErrorCode.CAP_MISMATCH, None, 409),  # KV of another model than the resident one
        (ErrorCode.TOO_LARGE, None, 413),
        (ErrorCode.BAD_FRAME, None, 400),
        (ErrorCode.NO_SLOT, None, 404),
        (ErrorCode.SLOT_BUSY, None, 503),
        (ErrorCode.NOT_IMPLEMENTED, None, 501),
        (ErrorCode.INTERNAL, None, 500),
        (ErrorCode.TIMEOUT, None, 500),
        (ErrorCode.BAD_JSON, Status.BAD_REQUEST, 400),
    ],
)
def test_http_status(code: ErrorCode, status: Status | None, expected: int) -> None:
    assert http_status(ProtocolError(code, "x", status=status)) == expected
