"""Raw HTTP/1.1 on a socket: every byte ours, replies read within bounds."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from .campaign_config import MAX_REPLY

# ---- raw HTTP/1.1 on a socket ----------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


class _ServerClosed(Exception):
    pass


async def _read_until(stream: trio.SocketStream, buf: bytearray, sep: bytes, limit: int) -> int:
    while (i := buf.find(sep)) < 0:
        if len(buf) > limit:
            raise ValueError("reply head too large")
        chunk = await _recv(stream)
        if not chunk:
            raise _ServerClosed(f"closed after {len(buf)} bytes")
        buf += chunk
    return i


async def _recv(stream: trio.SocketStream) -> bytes:
    try:
        return await stream.receive_some(1 << 16)
    except trio.BrokenResourceError:  # a reset reads as a close
        return b""


async def _read_exact(stream: trio.SocketStream, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = await _recv(stream)
        if not chunk:
            raise _ServerClosed(f"closed mid-body after {len(buf)}/{n} bytes")
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


async def read_reply(
    stream: trio.SocketStream, *, head_only: bool = False, buf: bytearray | None = None
) -> Reply:
    """One HTTP/1.1 response (Content-Length, chunked, or to the close; none for HEAD);
    _ServerClosed when the server closes before a whole one."""
    buf = bytearray() if buf is None else buf
    end = await _read_until(stream, buf, b"\r\n\r\n", 1 << 20)
    head = bytes(buf[:end]).decode("latin-1").split("\r\n")
    del buf[: end + 4]
    parts = head[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"bad status line {head[0][:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    for line in head[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if status in (100, 102, 103):  # an interim response: the real one follows
        return await read_reply(stream, head_only=head_only, buf=buf)
    if head_only:
        return Reply(status, headers, b"")
    return await _body(stream, buf, status, headers)


async def _body(
    stream: trio.SocketStream, buf: bytearray, status: int, headers: dict[str, str]
) -> Reply:
    if "content-length" in headers:
        return Reply(
            status, headers, await _read_exact(stream, buf, int(headers["content-length"]))
        )
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            i = await _read_until(stream, buf, b"\r\n", 1 << 16)
            size = int(bytes(buf[:i]).split(b";")[0], 16)
            del buf[: i + 2]
            if size == 0:
                return Reply(status, headers, bytes(out))
            out += await _read_exact(stream, buf, size + 2)
            del out[-2:]
            if len(out) > MAX_REPLY:
                raise ValueError("reply too large")
    if status in (204, 304) or status < 200:
        return Reply(status, headers, b"")
    out = bytearray(buf)
    while chunk := await _recv(stream):  # to the close
        out += chunk
        if len(out) > MAX_REPLY:
            raise ValueError("reply too large")
    return Reply(status, headers, bytes(out))


def http_request(
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[str, str]] | None = None,
    *,
    content_length: bool = True,
    port: int = 0,
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    hdrs = list(headers or [])
    if (
        content_length
        and body
        and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in hdrs)
    ):
        hdrs.append(("Content-Length", str(len(body))))
    lines += [f"{k}: {v}" for k, v in hdrs]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body
