"""The one patch of Hypercorn (http/plumbing/connections.py install): every private member it relies on
is checked before the server starts, and a Hypercorn without one fails with a clear error
naming the version and the member, never serves with a gate that silently does nothing."""

from __future__ import annotations

from typing import Any

import h11
import hypercorn.trio.run
import pytest
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from prometheus_client import CollectorRegistry

from hydra_trio.http.plumbing import connections
from hydra_trio.http.plumbing.connections import HypercornSeamError, _GatedTCPServer


def test_the_installed_hypercorn_has_every_member_the_handler_relies_on() -> None:
    assert connections._seam_missing() == []


def test_install_puts_the_handler_in_hypercorns_worker_once(monkeypatch: Any) -> None:
    monkeypatch.setattr(hypercorn.trio.run, "TCPServer", TCPServer)
    connections.install()
    assert hypercorn.trio.run.TCPServer is _GatedTCPServer
    connections.install()  # idempotent
    assert hypercorn.trio.run.TCPServer is _GatedTCPServer


def _without_idle_task(self: Any, *args: Any) -> None:
    self.send_lock = None  # not a trio.Lock either


def _unused(*args: Any) -> None:
    return None


@pytest.mark.parametrize(
    ("owner", "name", "value", "named"),
    [
        (TCPServer, "_read_data", None, "TCPServer._read_data"),
        (TCPServer, "_close", None, "TCPServer._close"),
        (TCPServer, "protocol_send", _unused, "TCPServer.protocol_send"),  # no longer a coroutine
        (TCPServer, "__init__", _without_idle_task, "TCPServer.send_lock"),
        (TCPServer, "__init__", _without_idle_task, "TCPServer.idle_task.stop"),
        (H11Protocol, "__init__", _unused, "H11Protocol.connection"),
        (hypercorn.trio.run, "TCPServer", None, "hypercorn.trio.run.TCPServer"),
    ],
)
def test_a_hypercorn_without_a_member_is_refused_by_name(
    monkeypatch: Any, owner: Any, name: str, value: Any, named: str
) -> None:
    monkeypatch.setattr(hypercorn.trio.run, "TCPServer", TCPServer)  # not installed yet
    if value is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, value)
    monkeypatch.setattr(connections, "_hypercorn_version", lambda: "9.9.9")
    with pytest.raises(HypercornSeamError) as err:
        connections.install()
    message = str(err.value)
    assert "Hypercorn 9.9.9" in message and named in message, message
    assert connections.HYPERCORN_TESTED in message


def test_a_worker_that_no_longer_looks_the_handler_up_is_refused(monkeypatch: Any) -> None:
    monkeypatch.setattr(hypercorn.trio.run, "TCPServer", TCPServer)

    async def worker_serve(*args: Any, **kwargs: Any) -> None:  # builds its handler some other way
        return None

    monkeypatch.setattr(hypercorn.trio.run, "worker_serve", worker_serve)
    with pytest.raises(HypercornSeamError, match=r"hypercorn\.trio\.run\.TCPServer"):
        connections.install()
    assert hypercorn.trio.run.TCPServer is TCPServer  # nothing patched


# ---- the overflow reserve's replies, read and framed by h11 -------------------------------------


def _gate() -> connections.ConnectionGate:
    return connections.ConnectionGate(0, lambda: (200, {"status": "ok"}, {}), CollectorRegistry())


def _client_reads(reply: bytes, method: str = "GET") -> tuple[int, dict[bytes, bytes], bytes]:
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(reply)
    client.receive_data(b"")
    head = client.next_event()
    body = b""
    while isinstance(event := client.next_event(), h11.Data):
        body += event.data
    assert isinstance(head, h11.Response) and isinstance(event, h11.EndOfMessage)
    return head.status_code, dict(head.headers), body


@pytest.mark.parametrize(
    ("head", "status", "body"),
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 200, b'{"status":"ok"}'),
        (b"GET /health?x=1 HTTP/1.0\r\n\r\n", 200, b'{"status":"ok"}'),
        (b"POST /health HTTP/1.1\r\nHost: x\r\n\r\n", 503, None),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 503, None),
        (b"not http at all\r\n\r\n", 503, None),
    ],
)
def test_an_overflow_reply_is_well_framed_http(head: bytes, status: int, body: bytes | None) -> None:
    got_status, headers, got_body = _client_reads(_gate()._reply(head))
    assert got_status == status and headers[b"connection"] == b"close"
    assert headers[b"content-type"] == b"application/json"
    if body is not None:
        assert got_body == body
    else:
        assert headers[b"retry-after"] == b"1" and b"--max-http-connections" in got_body


def test_an_overflow_reply_to_head_has_no_body() -> None:
    reply = _gate()._reply(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = _client_reads(reply, "HEAD")
    assert status == 503 and body == b"" and reply.endswith(b"\r\n\r\n")
