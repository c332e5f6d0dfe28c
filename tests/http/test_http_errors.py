"""How protocol errors map to HTTP statuses: the caller's faults are 4xx, the engine's 5xx."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from hydra_trio.http.plumbing import http_status
from hydra_trio.wire import ErrorCode, ProtocolError, Status


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


async def test_a_silent_http_connection_is_closed_after_the_idle_timeout(start_engine: Any, tiny_model: Path) -> None:
    """A connection that never sends a byte holds a descriptor only until
    --http-idle-timeout-s; then the engine closes it (the client sees EOF)."""
    ep = await start_engine(tiny_model, http_idle_timeout_s=0.5)
    stream = await trio.open_tcp_stream("127.0.0.1", ep.http_port)
    with trio.fail_after(10):
        assert await stream.receive_some(100) == b""
    await stream.aclose()


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    import resource

    from hydra_trio.cli import raise_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        before, now = raise_file_limit()
        assert before == min(1024, hard) and now == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
