"""Helpers shared by the integration tests; not collected (no test_ prefix).

The one tool that makes the lifecycle tests deterministic is ``WorkerGate``: the test task
holds the engine's GPU-worker limiter (``engine._core.worker.limiter``, a CapacityLimiter(1)), so
every llama.cpp call queues behind it. ``step()`` hands the worker to exactly one queued
call and takes it back (trio's limiter is FIFO and hands the token over on release), so a
request can be advanced one GPU call at a time and observed between calls.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import outcome
import trio
from hypothesis import strategies as st

from hydra_trio.decode.store import DecodeEntry, Tombstone
from hydra_trio.engine.llama import PrefillPart, StepRequest, StepResult
from hydra_trio.rpc.client import (
    RpcClient,
    RpcConnectionClosed,
    RpcResponse,
    build_decode_frame,
    decode_call,
    identity_kv_metadata,
    prefill_call,
    state_get_call,
    state_meta_call,
)

# Shared with the benchmarks (hydra_trio.testing); re-exported for the tests' one import.
from hydra_trio.testing.metrics_reader import MetricSamples as MetricSamples
from hydra_trio.testing.metrics_reader import metric_samples as metric_samples
from hydra_trio.testing.net import free_port as free_port
from hydra_trio.testing.sse_reader import parse_sse as parse_sse
from hydra_trio.testing.sse_reader import sse_chunk as sse_chunk
from hydra_trio.testing.sse_reader import sse_data as sse_data
from hydra_trio.testing.sse_reader import sse_text as sse_text
from hydra_trio.wire import Status, encode_v3_raw, parse_kv_blob

MESSAGES = [{"role": "user", "content": "hello world"}]
OTHER_MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "tell me a story"},
]
# MESSAGES plus an assistant answer and an extra user turn: its rendering extends the
# rendering of MESSAGES without a generation prompt.
EXTENDED_MESSAGES = [
    *MESSAGES,
    {"role": "assistant", "content": "hi there"},
    {"role": "user", "content": "tell me a story about the world"},
]
# ~1370 prompt tokens on the tiny model (a long delta prefill; fits a 2048 context).
LONG_TURN = {"role": "user", "content": "the slot cache engine " * 90}

POLL_S = 0.005
# Every §6.3 key (the spec's list plus "ours").
HYDRA_METRICS_KEYS = {
    "decode_request_id",
    "id_slot",
    "n_past",
    "decode_ms",
    "prompt_ms",
    "model_load_ms",
    "restore_slot_ms",
    "model_identity",
    "match",
    "model_fallback",
    "n_common",
    "n_prompt_processed",
    "logits_reused",
    "kv_bytes",
    "t3_reloaded",
    "t3_reload_ms",
    "decode_init_ms",
    "validate_ms",
    "queue_wait_ms",
    "ttft_ms",
    "tokens_per_s",
    "stop_type",
    "session_id",
}
MATCH_KEYS = {
    "tokenizer_match",
    "model_name_match",
    "model_quant_match",
    "model_capabilities_match",
    "model_alias_match",
    "capabilities_xor",
    "capabilities_diff_bits",
}
INT32_MAX = (1 << 31) - 1


# ---- waiting ---------------------------------------------------------------------------


async def wait_until(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Poll ``check`` (sync or async) until true; trio.TooSlowError after ``timeout_s``."""
    with trio.fail_after(timeout_s):
        while True:
            value = check()
            if not isinstance(value, bool):
                value = await value
            if value:
                return
            await trio.sleep(POLL_S)


async def wait_slots_until(engine: Any, check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``check()`` holds, looking again each time a slot is released (slots are
    released when a request ends and when a staged reconfiguration has been applied)."""
    with trio.fail_after(timeout_s):
        while not check():
            await engine._core.slots.wait_released()


async def wait_slots_idle(engine: Any, timeout_s: float = 10.0) -> None:
    await wait_slots_until(engine, engine._core.slots.all_idle, timeout_s)


# ---- the GPU-worker gate -----------------------------------------------------------------


class WorkerGate:
    """The test task holding the engine's GPU-worker limiter. Use via ``gate(ep)``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.limiter: trio.CapacityLimiter = engine._core.worker.limiter
        self.held = False

    async def close(self) -> None:
        """Take the worker (waits for the call running now, if any)."""
        assert not self.held
        self.engine._core.worker.wants_turn.set()  # as any caller: a run of steps ends after one
        await self.limiter.acquire()
        self.held = True

    def open(self) -> None:
        """Give the worker back for good (until the next close())."""
        assert self.held
        self.held = False
        self.limiter.release()

    @property
    def waiting(self) -> int:
        return self.limiter.statistics().tasks_waiting

    async def wait_queued(self, n: int = 1, timeout_s: float = 10.0) -> None:
        """Wait until ``n`` calls are queued for the worker behind us."""
        await wait_until(lambda: self.waiting >= n, timeout_s)

    async def step(self, n: int = 1) -> None:
        """Let exactly ``n`` queued worker calls run, one after the other, then hold again."""
        assert self.held
        for _ in range(n):
            await self.wait_queued(1)
            self.limiter.release()  # FIFO: the token goes to the queued call
            # Queued behind it, asking for the worker as any caller does (a run of generation
            # steps returns after one step); back once it finished.
            self.engine._core.worker.wants_turn.set()
            await self.limiter.acquire()


@asynccontextmanager
async def gate(ep: Any, *, closed: bool = True) -> AsyncIterator[WorkerGate]:
    """A WorkerGate, closed on entry; always released on exit (the engine's shutdown needs
    the worker, so a failing test must not leave it held)."""
    g = WorkerGate(ep.state.engine)
    if closed:
        await g.close()
    try:
        yield g
    finally:
        if g.held:
            g.open()


# ---- HTTP ----------------------------------------------------------------------------------


def http(ep: Any, *, api_key: str | None = None, **kw: Any) -> httpx.AsyncClient:
    """A client for ``ep``'s HTTP port; ``api_key`` defaults to the key the engine was
    started with (none: no Authorization header)."""
    key = api_key if api_key is not None else ep.state.settings.http_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{ep.http_port}",
        timeout=90.0,
        headers={**headers, **kw.pop("headers", {})},
        **kw,
    )


async def chat_completion(
    h: httpx.AsyncClient, messages: list[dict[str, Any]], n_predict: int
) -> dict[str, Any]:
    r = await h.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": n_predict, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


async def get_result(h: httpx.AsyncClient, rid: int, wait_s: float = 60.0) -> dict[str, Any]:
    """The finished result of a decode request (blocks with ?wait)."""
    r = await h.get(f"/v1/decode/{rid}", params={"wait": wait_s})
    assert r.status_code == 200, (r.status_code, r.text)
    body = r.json()
    assert body["object"] == "chat.completion"
    return body


def text_of(body: dict[str, Any]) -> str:
    return body["choices"][0]["message"]["content"]


async def listed(h: httpx.AsyncClient) -> list[dict[str, Any]]:
    r = await h.get("/v1/decode")
    assert r.status_code == 200, r.text
    return r.json()


async def wait_listed(h: httpx.AsyncClient, state: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The (single) entry of GET /v1/decode in ``state``, once there is one."""
    found: list[dict[str, Any]] = []

    async def check() -> bool:
        found[:] = [e for e in await listed(h) if e["state"] == state]
        return bool(found)

    await wait_until(check, timeout_s)
    assert len(found) == 1, found
    return found[0]


SSE_HEADERS = {"Accept": "text/event-stream"}


async def stream_then_hang_up(h: httpx.AsyncClient, path: str, body: dict[str, Any], after: int) -> None:
    """POST a streaming request, read ``after`` data events, then close the response without
    reading the rest (the connection is dropped: the client has left)."""
    seen = 0
    async with h.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if sse_data(line) is not None:
                seen += 1
                if seen >= after:
                    return


def reset_on_close(stream: trio.SocketStream) -> None:
    """SO_LINGER 0: close() sends a reset (RST) instead of a FIN: the peer hangs up for
    good (a FIN alone may be a half-close, which the engine answers on DECODE; see
    rpc/peer.py)."""
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# ---- RPC -----------------------------------------------------------------------------------


async def rpc(ep: Any) -> RpcClient:
    return await RpcClient.connect("127.0.0.1", ep.rpc_port)


async def prefill(
    c: RpcClient, slot: int, messages: list[dict[str, Any]], **extra: Any
) -> RpcResponse:
    resp = await c.call(prefill_call(slot, {"messages": messages, **extra}))
    assert resp.ok
    return resp


def kv_meta(pre: RpcResponse) -> dict[str, Any]:
    return identity_kv_metadata(pre.meta, pre.meta["n_past"])


def frame(
    messages: list[dict[str, Any]] | None,
    kv: bytes | bytearray = b"",
    *,
    n_predict: int = 16,
    kv_metadata: dict[str, Any] | None = None,
    model: str = "",
    **request: Any,
) -> bytes:
    """A v3 DECODE frame, greedy, the generation settings in the prompt segment."""
    body = {"n_predict": n_predict, "temperature": 0, **request}
    if messages is not None:
        body["messages"] = messages
    return build_decode_frame(body, bytes(kv), kv_metadata=kv_metadata, model=model)


def v3_raw(
    header: dict[str, Any],
    prompt: bytes,
    kv: bytes,
    *,
    prompt_hash: str = "",
    kv_hash: str = "",
    header_hash: int | None = None,
) -> bytes:
    """A hand-made v3 frame: explicit segment hashes and (optionally wrong) header hash."""
    head = dict(header)
    head["v"] = 3
    head["segments"] = [
        {"id": "prompt", "offset": 0, "len": len(prompt), "hash": prompt_hash},
        {"id": "kv", "offset": len(prompt), "len": len(kv), "hash": kv_hash},
    ]
    header_json = json.dumps(head, separators=(",", ":")).encode()
    return encode_v3_raw(header_json, prompt + kv, header_hash=header_hash)


async def decode(c: RpcClient, slot: int, payload: bytes) -> RpcResponse:
    """DECODE without raising on a non-OK reply."""
    return await c.call(decode_call(slot, payload), check=False)


async def decode_ok(c: RpcClient, slot: int, payload: bytes) -> int:
    resp = await decode(c, slot, payload)
    assert resp.status == Status.OK, resp.meta
    rid = resp.meta["decode_request_id"]
    assert isinstance(rid, int) and 0 < rid <= INT32_MAX
    return rid


async def slot_meta(c: RpcClient, slot: int) -> dict[str, Any]:
    resp = await c.call(state_meta_call(slot))
    return resp.meta


async def slot_tokens(c: RpcClient, slot: int) -> list[int]:
    """The slot's tokens from a STATE_GET blob (needs the GPU worker and a free slot)."""
    resp = await c.call(state_get_call(slot))
    blob = parse_kv_blob(resp.payload)
    assert blob.n_past == len(blob.tokens) == resp.meta["n_past"]
    return blob.tokens


# ---- in-process views --------------------------------------------------------------------


def store(ep: Any) -> Any:
    return ep.state.decodes.store


def entry_of(ep: Any, rid: int) -> DecodeEntry:
    found = store(ep).get(rid)
    assert isinstance(found, DecodeEntry), found
    return found


def tombstone_state(ep: Any, rid: int) -> str | None:
    found = store(ep).get(rid)
    return found.state.value if isinstance(found, Tombstone) else None


@dataclass
class Collected:
    """What one SSE reader saw."""

    status: int = 0
    lines: list[str] | None = None


async def read_sse(
    h: httpx.AsyncClient, rid: int, out: Collected, *, stop_after: int | None = None
) -> None:
    """Read the SSE stream of ``rid`` into ``out``; with ``stop_after``, disconnect after that
    many data events."""
    out.lines = []
    async with h.stream("GET", f"/v1/decode/{rid}", headers=SSE_HEADERS) as r:
        out.status = r.status_code
        n = 0
        async for line in r.aiter_lines():
            out.lines.append(line)
            if sse_data(line) is not None:
                n += 1
                if stop_after is not None and n >= stop_after:
                    return


# ---- /metrics ---------------------------------------------------------------------------------

async def scrape(c: httpx.AsyncClient) -> MetricSamples:
    r = await c.get("/metrics")
    assert r.status_code == 200
    return metric_samples(r.text)


# ---- HTTP chat and RPC health (integration tests) -------------------------------------------


async def chat(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    if "prompt" not in body:
        body.setdefault("messages", MESSAGES)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def stream_chat(client: httpx.AsyncClient, **body: Any) -> tuple[list[dict[str, Any]], bool, httpx.Response]:
    body.setdefault("messages", MESSAGES)
    body["stream"] = True
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        lines = [line async for line in r.aiter_lines()]
    chunks, done = parse_sse(lines)
    return chunks, done, r


async def chat_text(client: httpx.AsyncClient, *, stream: bool, **body: Any) -> tuple[str, dict[str, Any]]:
    """(text, final object: the completion body, or the last SSE chunk) of a chat."""
    if not stream:
        done_body = await chat(client, **body)
        return done_body["choices"][0]["message"]["content"], done_body
    events, done, _ = await stream_chat(client, **body)
    assert done
    return sse_text(events), events[-1]


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
    from hydra_trio.wire import parse_kv_blob

    if n_vocab is not None:
        a = a[: len(a) - 4 * n_vocab]
    pa, pb = parse_kv_blob(a), parse_kv_blob(b)
    assert pa.n_past == pb.n_past and pa.tokens == pb.tokens
    assert len(pa.state) == len(pb.state)


# One llama.cpp thread per engine in these tests: the tiny models gain nothing from more, and
# ggml's spinning thread barriers make a 2-thread engine crawl (seconds per request) when other
# processes hold the CPUs of a small CI box.
ENGINE = {"threads": 1}


def chat_plan(chat: Any, request: dict[str, Any], *, budget: int = -1) -> Any:
    """``Chat.plan`` of ``request`` outside an engine (its tools and constraint parsed by the
    one request parser; its grammar written on this thread): for tests of the plan's decisions."""
    from hydra_trio.engine.params import parse_generation

    params = parse_generation(request, default_n_predict=16, n_ctx=4096, default_reasoning_budget=budget)

    async def off_loop(fn: Callable[[], Any]) -> Any:
        return fn()

    async def plan() -> Any:
        return await chat.plan(
            request, tools=params.tools, constraint=params.constraint, budget=params.reasoning_budget, off_loop=off_loop
        )

    return trio.run(plan)


# ---- shared by test modules in different folders (tests/README.md) -------------------------

# OpenAI's error shape (tests/http/test_http_openai.py and the routes' other tests)
ERROR_TYPES = {"invalid_request_error", "server_error", "unavailable_error"}


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    err = body["error"]
    assert err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ERROR_TYPES
    return body


PREFILL_PARAMS = {  # what vllm-router's P/D mode sends to the prefill engine
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# JSON schemas of one object for the grammar properties (hypothesis)
_SCALARS = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda n: {"type": "string", "minLength": n, "maxLength": n + 3}, st.integers(0, 3)),
    st.just({"type": "integer"}),
    st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w}, st.integers(-50, 50),
              st.integers(0, 100)),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.builds(
        lambda vals: {"enum": vals},
        st.lists(st.one_of(st.text("abcxyz", min_size=1, max_size=4), st.integers(-9, 99)), min_size=1, max_size=4,
                 unique=True),
    ),
)
_VALUES = st.one_of(
    _SCALARS,
    st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, _SCALARS, st.integers(0, 3)),
)


@st.composite
def object_schemas(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.text("abcdefgh_", min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
    props = {name: draw(_VALUES) for name in names}
    required = [n for n in names if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


# The step batcher's stand-in llama calls (tests/engine/sched/test_batcher.py)
class Recorder:
    """run_steps / run_mixed stand-ins: record each batch; step k of a slot samples 100+k."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[int], list[tuple[int, int]]]] = []  # (step slots, (slot, n tokens) parts)
        self.calls_returned = 0  # runs of steps that returned

    def step_sync(self, reqs: Sequence[StepRequest], before_decode: Callable[[], None]) -> list[StepResult]:
        before_decode()
        self.batches.append(([r.slot for r in reqs], []))
        return [(r.token + 1,) for r in reqs]

    async def run_on_worker(self, fn: Callable[[], None]) -> None:
        await trio.to_thread.run_sync(fn)
        self.calls_returned += 1

    async def run_mixed(
        self, reqs: Sequence[StepRequest], parts: Sequence[PrefillPart]
    ) -> tuple[list[StepResult], list[Any]]:
        await trio.lowlevel.checkpoint()
        self.batches.append(([r.slot for r in reqs], [(p.slot, len(p.tokens)) for p in parts]))
        return [(r.token + 1,) for r in reqs], [outcome.Value((7, None)) for _ in parts]


async def no_wait() -> None:
    return None
