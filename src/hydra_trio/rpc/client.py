"""RPC client: an async (trio) client with one method per op, and a sync twin for scripts.

Both share the request builders and response handling below; they differ only in how bytes
move (trio stream vs blocking socket).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from ..transport import PeerClosed, RecvInto, draining_send, read_reply_head, recv_bytes, run_blocking
from ..wire.errors import Status
from ..wire.frames import encode_decode_frame_v3
from ..wire.protocol import Op, encode_request_header

Buffer = bytes | bytearray | memoryview


class RpcError(Exception):
    """A non-OK response: status, error_code and the whole meta."""

    def __init__(self, status: int, meta: dict[str, Any]) -> None:
        self.status = status
        self.meta = meta
        self.error_code = str(meta.get("error_code", ""))
        self.message = str(meta.get("error", ""))
        try:
            name = Status(status).name
        except ValueError:
            name = f"0x{status:02x}"
        super().__init__(f"{name} {self.error_code}: {self.message}")


class RpcConnectionClosed(Exception):
    """The server closed the connection instead of answering, or an earlier exchange on this
    client was interrupted (cancelled, timed out, failed) and the client closed it."""


def _interrupted(exc: BaseException) -> str:
    return (
        f"connection closed: an earlier call was interrupted mid-exchange ({type(exc).__name__}); "
        "its reply could arrive in place of the next one, so open a new client"
    )


@dataclass(slots=True)
class RpcResponse:
    status: int
    meta: dict[str, Any]
    payload: bytearray

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


@dataclass(frozen=True, slots=True)
class Call:
    op: int
    key: bytes
    payload: Sequence[Buffer]


def _key(slot: int | None) -> bytes:
    return b"" if slot is None else str(slot).encode()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def info_call() -> Call:
    return Call(Op.INFO, b"", ())


def state_get_call(slot: int) -> Call:
    return Call(Op.STATE_GET, _key(slot), ())


def state_put_call(slot: int, blob: Buffer | Sequence[Buffer]) -> Call:
    parts = [blob] if isinstance(blob, bytes | bytearray | memoryview) else list(blob)
    return Call(Op.STATE_PUT, _key(slot), parts)


def state_meta_call(slot: int) -> Call:
    return Call(Op.STATE_META, _key(slot), ())


def configure_call(slot: int | None, settings: dict[str, Any]) -> Call:
    return Call(Op.CONFIGURE, _key(slot), [_json(settings)])


def prefill_call(slot: int, request: dict[str, Any]) -> Call:
    return Call(Op.PREFILL, _key(slot), [_json(request)])


def decode_call(slot: int, frame: Buffer) -> Call:
    return Call(Op.DECODE, _key(slot), [frame])


def build_decode_frame(
    request: dict[str, Any] | list[Any] | None,
    kv: Buffer = b"",
    *,
    model: str = "",
    kv_metadata: dict[str, Any] | None = None,
    model_metadata: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
) -> bytes:
    """A v3 DECODE frame, as coordinators build it."""
    header = {
        "v": 3,
        "model": model,
        "kv_metadata": kv_metadata or {},
        "model_metadata": model_metadata or kv_metadata or {},
        "generation": generation or {},
    }
    return encode_decode_frame_v3(header, request, kv)


def identity_kv_metadata(meta: dict[str, Any], n_past: int) -> dict[str, Any]:
    """kv_metadata for a DECODE frame from a PREFILL/STATE_GET reply's identity fields, and
    the LoRA adapter set the KV was made under (``lora``, ours: absent for the base model)."""
    keys = ("tokenizer", "model_name", "model_quant", "model_capabilities", "model_alias", "lora")
    return {"n_past": n_past, **{k: meta[k] for k in keys if k in meta}}


def _request_bytes(call: Call, trace: bytes) -> list[Buffer]:
    payload_len = sum(len(p) for p in call.payload)
    head = encode_request_header(call.op, key_len=len(call.key), payload_len=payload_len, trace_len=len(trace))
    return [head, call.key, trace, *call.payload]


async def _read_response(recv_into: RecvInto) -> RpcResponse:
    """A call's reply, both clients': header and meta (reading.read_reply_head), then the
    payload. A socket error propagates as itself; a close is RpcConnectionClosed."""
    try:
        head, meta = await read_reply_head(recv_into)
        payload = await recv_bytes(recv_into, head.payload_len)
    except PeerClosed as exc:
        if exc.cause is not None:
            raise exc.cause from None
        raise RpcConnectionClosed(f"server closed the connection after {exc.got}/{exc.n} bytes") from None
    return RpcResponse(head.status, meta, payload)


def _finish(resp: RpcResponse, check: bool) -> RpcResponse:
    if check and not resp.ok:
        raise RpcError(resp.status, resp.meta)
    return resp


class _Methods:
    """One method per op over ``self.call`` (defined by the async and sync clients)."""

    call: Callable[..., Any]

    def info(self) -> Any:
        return self.call(info_call())

    def state_get(self, slot: int) -> Any:
        return self.call(state_get_call(slot))

    def state_put(self, slot: int, blob: Buffer | Sequence[Buffer]) -> Any:
        return self.call(state_put_call(slot, blob))

    def state_meta(self, slot: int) -> Any:
        return self.call(state_meta_call(slot))

    def configure(self, slot: int | None, settings: dict[str, Any]) -> Any:
        return self.call(configure_call(slot, settings))

    def prefill(self, slot: int, request: dict[str, Any]) -> Any:
        return self.call(prefill_call(slot, request))

    def decode(self, slot: int, frame: Buffer) -> Any:
        return self.call(decode_call(slot, frame))


class RpcClient(_Methods):
    """Async client on one persistent connection. Methods return RpcResponse or raise RpcError."""

    def __init__(self, stream: trio.SocketStream, trace: str = "") -> None:
        self._stream = stream
        self.trace = trace.encode()
        self._lock = trio.Lock()  # one request at a time: the protocol has no pipelining
        self._broken: str | None = None  # why the connection was closed under an exchange

    @classmethod
    async def connect(cls, host: str, port: int, *, trace: str = "") -> RpcClient:
        stream = await trio.open_tcp_stream(host, port)
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(stream, trace)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def call(self, call: Call, *, check: bool = True, trace: str | None = None) -> RpcResponse:
        t = trace.encode() if trace is not None else self.trace
        async with self._lock:
            if self._broken is not None:
                raise RpcConnectionClosed(self._broken)
            try:
                # No yield per write (a STATE_SET's blob is MBs); the caller's scope bounds it.
                await draining_send(self._stream.socket, _request_bytes(call, t), idle_timeout_s=None)
                resp = await self._read_response()
            except BaseException as exc:
                # Cancelled or failed between the first byte sent and the last byte read: the
                # stream position is unknown (a late reply would answer the next call), so the
                # connection cannot be reused. Closing is synchronous: no checkpoint here.
                self._broken = _interrupted(exc)
                self._stream.socket.close()
                raise
            return _finish(resp, check)

    async def send_raw(self, data: Buffer) -> None:
        """Send arbitrary bytes (tests of malformed requests)."""
        await self._stream.send_all(data)

    async def read_response(self) -> RpcResponse:
        return await self._read_response()

    async def _read_response(self) -> RpcResponse:
        return await _read_response(self._stream.socket.recv_into)


class SyncRpcClient(_Methods):
    """Blocking twin of RpcClient for scripts."""

    def __init__(self, host: str, port: int, *, timeout: float | None = 120.0, trace: str = "") -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.trace = trace.encode()
        self._broken: str | None = None  # why the connection was closed under an exchange

    def __enter__(self) -> SyncRpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def call(self, call: Call, *, check: bool = True, trace: str | None = None) -> RpcResponse:
        t = trace.encode() if trace is not None else self.trace
        if self._broken is not None:
            raise RpcConnectionClosed(self._broken)
        try:
            for part in _request_bytes(call, t):
                if len(part):
                    self._sock.sendall(part)
            resp = run_blocking(_read_response(self._recv_into))
        except BaseException as exc:  # a socket timeout, Ctrl-C, a bad reply: same hazard as above
            self._broken = _interrupted(exc)
            self._sock.close()
            raise
        return _finish(resp, check)

    async def _recv_into(self, view: memoryview, n: int) -> int:
        return self._sock.recv_into(view, n)  # blocks, never suspends: for run_blocking
