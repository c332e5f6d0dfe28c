"""Helpers shared by the integration tests (not collected: no test_ prefix)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio

from hydra_trio.rpc.client import RpcClient, RpcConnectionClosed, RpcResponse, state_meta_call
from hydra_trio.wire.errors import Status

MESSAGES = [{"role": "user", "content": "hello world"}]
OTHER_MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]
POLL_S = 0.01


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Poll ``check`` until it is true; TooSlowError after ``timeout_s``."""
    with trio.fail_after(timeout_s):
        while not await check():  # noqa: ASYNC110 - polling a remote state, not a local event
            await trio.sleep(POLL_S)


def http_client(ep: Any, *, api_key: str | None = None, **kw: Any) -> httpx.AsyncClient:
    """A client for ``ep``'s HTTP port; ``api_key`` defaults to the key the engine was
    started with (none: no Authorization header)."""
    key = api_key if api_key is not None else ep.state.settings.http_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{ep.http_port}", timeout=30.0, headers={**headers, **kw.pop("headers", {})}, **kw
    )


async def chat(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    if "prompt" not in body:
        body.setdefault("messages", MESSAGES)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def parse_sse(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """(chunks, saw [DONE]) from the ``data:`` lines of an SSE body."""
    chunks: list[dict[str, Any]] = []
    done = False
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            assert not done, "two [DONE] events"
            done = True
            continue
        assert not done, "event after [DONE]"
        chunks.append(json.loads(data))
    return chunks, done


async def stream_chat(client: httpx.AsyncClient, **body: Any) -> tuple[list[dict[str, Any]], bool, httpx.Response]:
    body.setdefault("messages", MESSAGES)
    body["stream"] = True
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        lines = [line async for line in r.aiter_lines()]
    chunks, done = parse_sse(lines)
    return chunks, done, r


def stream_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if "choices" in c)


async def rpc(ep: Any) -> RpcClient:
    return await RpcClient.connect("127.0.0.1", ep.rpc_port)


async def slot_metas(ep: Any) -> list[dict[str, Any]]:
    """STATE_META of every slot, on a fresh connection."""
    async with await rpc(ep) as c:
        info = await c.info()
        return [(await c.call(state_meta_call(i))).meta for i in range(info.meta["n_slots"])]


async def assert_server_healthy(ep: Any) -> None:
    """A fresh INFO works and no slot is stuck busy (waits for in-flight cleanups)."""

    async def idle() -> bool:
        return not any(m["is_processing"] or m["is_transferring"] for m in await slot_metas(ep))

    await wait_until(idle, 10.0)
    async with await rpc(ep) as c:
        info = await c.info()
        assert info.ok and info.meta["engine"] == "hydra-trio"


def assert_error(resp: RpcResponse, status: Status, code: str) -> None:
    assert resp.status == status, (Status(resp.status).name, resp.meta)
    assert resp.meta.get("error_code") == code, resp.meta
    assert isinstance(resp.meta.get("error"), str) and resp.meta["error"], resp.meta
    assert resp.payload == b""


async def expect_closed(client: RpcClient, timeout_s: float = 10.0) -> None:
    """The server closes the connection without sending (more) bytes."""
    with trio.fail_after(timeout_s):
        try:
            resp = await client.read_response()
        except (RpcConnectionClosed, trio.BrokenResourceError, ConnectionResetError):
            return
    raise AssertionError(f"expected the connection to be closed, got a response {resp}")


def assert_same_kv(a: bytes | bytearray, b: bytes | bytearray, *, n_vocab: int | None = None) -> None:
    """Two v2 blobs hold the same positions and tokens. With ``n_vocab``, trailing logits of
    ``a`` are dropped first (PREFILL blob vs STATE_GET blob).

    Only blobs read from the same slot id can be compared byte for byte: llama.cpp's
    sequence state records the sequence id in its header and in every cell.
    """
    from hydra_trio.wire.kvblob import parse_kv_blob

    if n_vocab is not None:
        a = a[: len(a) - 4 * n_vocab]
    pa, pb = parse_kv_blob(a), parse_kv_blob(b)
    assert pa.n_past == pb.n_past and pa.tokens == pb.tokens
    assert len(pa.state) == len(pb.state)


# One llama.cpp thread per engine in these tests: the tiny models gain nothing from more, and
# ggml's spinning thread barriers make a 2-thread engine crawl (seconds per request) when other
# processes hold the CPUs of a small CI box.
ENGINE = {"threads": 1}
