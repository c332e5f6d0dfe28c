"""The fault matrix (issue 9): a client that disconnects at each stage of a DECODE, a reader
that leaves mid-SSE, DELETE at each stage of a request, and SIGTERM (once, then twice) on a
real `hydra-trio serve` process with decodes and streaming chats in flight.

After each fault: no slot stuck busy, no task left behind (trio's task tree is back to its
size before the fault), no request still running, and no resurrected entry (a cancelled id
stays a tombstone after a later request on the same slot ran to its end).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from helpers import (
    MESSAGES,
    Collected,
    assert_server_healthy,
    decode,
    decode_ok,
    entry_of,
    frame,
    free_port,
    gate,
    get_result,
    http,
    kv_meta,
    prefill,
    read_sse,
    reset_on_close,
    rpc,
    sse_data,
    store,
    tombstone_state,
    wait_listed,
    wait_until,
)
from hydra_trio.rpc.client import RpcClient, SyncRpcClient, build_decode_frame
from hydra_trio.testing.sse_reader import DONE
from hydra_trio.wire import Op, Status, encode_request

LONG_N = 1500  # far more than a test lets run before its fault
N = 8


# ---- what "clean" means -----------------------------------------------------------------------


def task_count() -> int:
    """Every task in this trio run (the engine runs in-process)."""

    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


async def baseline_tasks() -> int:
    await trio.testing.wait_all_tasks_blocked()
    return task_count()


async def assert_clean(ep: Any, baseline: int, cancelled: list[int] = ()) -> None:  # type: ignore[assignment]
    """No running request, no busy slot, the task tree back to ``baseline``; each id in
    ``cancelled`` stays a tombstone after a later request on its slot ran to its end."""
    engine = ep.state.engine
    await wait_until(lambda: not store(ep).running(), 10)
    assert not any(s.busy for s in engine._core.slots.slots)
    async with http(ep) as h, await rpc(ep) as c:
        for slot in range(len(engine._core.slots)):
            await get_result(h, await decode_ok(c, slot, frame(MESSAGES, n_predict=N)))
        for rid in cancelled:
            r = await h.get(f"/v1/decode/{rid}")
            assert r.status_code == 410, (rid, r.status_code, r.text)
    await assert_server_healthy(ep)
    # Connections the checks opened end asynchronously on the server side.
    await wait_until(lambda: task_count() == baseline, 10)



# ---- a client disconnects at each stage of a DECODE ------------------------------------------


STAGES = ["mid_header", "mid_payload", "before_ack_close", "before_ack_reset", "after_ack"]


@pytest.mark.parametrize("stage", STAGES)
async def test_disconnect_at_each_stage_of_a_decode(start_engine: Any, tiny_model: Path, stage: str) -> None:
    ep = await start_engine(tiny_model)
    async with await rpc(ep) as c:
        pre = await prefill(c, 1, MESSAGES)
    n_predict = N if stage == "after_ack" else LONG_N
    data = encode_request(Op.DECODE, b"0", frame(MESSAGES, pre.payload, n_predict=n_predict, kv_metadata=kv_meta(pre)))
    baseline = await baseline_tasks()
    raw = await trio.open_tcp_stream("127.0.0.1", ep.rpc_port)
    cancelled: list[int] = []
    if stage in ("mid_header", "mid_payload"):
        cut = 9 if stage == "mid_header" else 16 + 1 + (len(data) - 17) // 2
        await raw.send_all(data[:cut])
        await trio.testing.wait_all_tasks_blocked()  # the server has read what there is
        await raw.aclose()
        assert store(ep).entries() == []  # nothing was started
    elif stage in ("before_ack_close", "before_ack_reset"):
        async with http(ep) as h, gate(ep) as g:
            await raw.send_all(data)
            rid = (await wait_listed(h, "restoring"))["decode_request_id"]
            await g.wait_queued(1)  # the restore waits for the GPU worker
            entry = entry_of(ep, rid)
            if stage == "before_ack_reset":
                reset_on_close(raw)
            await raw.aclose()
        with trio.fail_after(30):
            await entry.ended.wait()
        assert tombstone_state(ep, rid) == "cancelled"
        cancelled.append(rid)
    else:
        client = RpcClient(raw)
        await raw.send_all(data)
        resp = await client.read_response()
        assert resp.status == Status.OK, resp.meta
        await raw.aclose()
        async with http(ep) as h:
            body = await get_result(h, resp.meta["decode_request_id"])
        assert body["usage"]["completion_tokens"] == N  # the hang-up after the ack stopped nothing
    await assert_clean(ep, baseline, cancelled)


# ---- a reader leaves mid-SSE ----------------------------------------------------------------


async def test_decode_reader_leaving_mid_sse_stops_nothing_and_leaves_nothing(
    start_engine: Any, tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    baseline = await baseline_tasks()
    async with http(ep) as h, await rpc(ep) as c:
        rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=LONG_N))
        seen = Collected()
        await read_sse(h, rid, seen, stop_after=3)
        entry = entry_of(ep, rid)
        await wait_until(lambda: entry.reader_count == 0)
        assert entry.state.value in ("generating", "done")  # the reader's leaving stopped nothing
        r = await h.delete(f"/v1/decode/{rid}")
        assert r.status_code == 200, r.text
    await assert_clean(ep, baseline, [rid])


async def test_chat_reader_leaving_mid_sse_cancels_the_chat(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model)
    engine = ep.state.engine
    baseline = await baseline_tasks()
    async with http(ep) as h:
        body = {"messages": MESSAGES, "max_tokens": LONG_N, "temperature": 0, "stream": True}
        async with h.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            async for line in r.aiter_lines():
                events += sse_data(line) is not None
                if events >= 3:
                    break
        evaluated = engine._core.tokens_evaluated
    # The chat's producer belongs to its request: the client leaving cancels it.
    await wait_until(lambda: not any(s.busy for s in engine._core.slots.slots), 10)
    assert engine._core.tokens_evaluated - evaluated < LONG_N
    await assert_clean(ep, baseline)


# ---- DELETE at each stage --------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["restoring", "generating", "done", "twice_at_once"])
async def test_delete_at_each_stage(start_engine: Any, tiny_model: Path, stage: str) -> None:
    ep = await start_engine(tiny_model)
    async with await rpc(ep) as c:
        pre = await prefill(c, 1, MESSAGES)
    baseline = await baseline_tasks()
    tombstones: list[int] = []
    async with http(ep) as h, await rpc(ep) as c, trio.open_nursery() as nursery:
        if stage == "restoring":
            replies: list[Any] = []
            async with gate(ep) as g:
                payload = frame(MESSAGES, pre.payload, n_predict=LONG_N, kv_metadata=kv_meta(pre))

                async def call() -> None:
                    replies.append(await decode(c, 0, payload))

                nursery.start_soon(call)
                rid = (await wait_listed(h, "restoring"))["decode_request_id"]
                await g.wait_queued(1)
                async with trio.open_nursery() as deleting:  # DELETE waits for the worker too
                    deleting.start_soon(h.delete, f"/v1/decode/{rid}")
                    await wait_until(lambda: tombstone_state(ep, rid) == "cancelled")
            await wait_until(lambda: bool(replies))
            assert replies[0].status != Status.OK and replies[0].meta["decode_request_id"] == rid
            tombstones.append(rid)
        elif stage in ("generating", "twice_at_once"):
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=LONG_N))
            entry = entry_of(ep, rid)
            await wait_until(lambda: len(entry.chunks) > 0)
            codes: list[int] = []

            async def delete() -> None:
                codes.append((await h.delete(f"/v1/decode/{rid}")).status_code)

            for _ in range(2 if stage == "twice_at_once" else 1):
                nursery.start_soon(delete)
            await wait_until(lambda: len(codes) == (2 if stage == "twice_at_once" else 1))
            assert codes[0] == 200 and all(code in (200, 410) for code in codes), codes
            assert tombstone_state(ep, rid) == "cancelled"
            tombstones.append(rid)
        else:
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=N))
            await get_result(h, rid)
            r = await h.delete(f"/v1/decode/{rid}")
            assert r.status_code == 200 and r.json()["state"] == "deleted", r.text
            tombstones.append(rid)
    await assert_clean(ep, baseline, tombstones)


# ---- SIGTERM on a real process -----------------------------------------------------------------


class Served:
    """`hydra-trio serve` in its own process, its log in a file."""

    def __init__(self, model: Path, log: Path, *extra: str) -> None:
        self.http, self.rpc = free_port(), free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hydra_trio.cli", "serve", "--model", str(model), "--port", str(self.http),
             "--rpc-port", str(self.rpc), "--slots", "3", "--ctx-size", "4096", "--threads", "1", *extra],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            self.wait_for(lambda: self._healthy(), 60)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.text()
        try:
            return httpx.get(f"http://127.0.0.1:{self.http}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    @staticmethod
    def wait_for(check: Any, timeout_s: float) -> None:
        """A subprocess offers no event to wait on: poll, bounded."""
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not met in time")
            time.sleep(0.02)

    def finish(self, timeout_s: float = 60) -> str:
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.text()


class ChatReader(threading.Thread):
    """A streaming chat read in a thread: how many chunks, and how the stream ended."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.chunks = 0
        self.started_streaming = threading.Event()
        self.ending = ""

    def run(self) -> None:
        body = {"messages": MESSAGES, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if sse_data(line) == DONE:
                        self.ending = "done"
                    elif sse_data(line) is not None:
                        self.chunks += 1
                        if self.chunks >= 2:
                            self.started_streaming.set()
            self.ending = self.ending or "ended without [DONE]"
        except httpx.HTTPError as exc:
            self.ending = f"cut: {type(exc).__name__}"
        finally:
            self.started_streaming.set()


def _start_decode(port: int, n: int) -> int:
    """A DECODE on the last slot (the chats take the first ones)."""
    with SyncRpcClient("127.0.0.1", port) as client:
        request = {"messages": [{"role": "user", "content": "a long story"}], "max_tokens": n}
        return int(client.decode(2, build_decode_frame(request, b"")).meta["decode_request_id"])


@pytest.fixture
def serve_process(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """``serve_process(*flags)`` -> Served; killed at teardown if a test left it running."""
    started: list[Served] = []

    def start(*extra: str) -> Served:
        started.append(Served(tiny_model, tmp_path / f"serve{len(started)}.log", *extra))
        return started[-1]

    yield start
    for served in started:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()


def test_sigterm_with_decodes_and_streaming_chats_in_flight(serve_process: Callable[..., Served]) -> None:
    """The drain lets the running decode finish; the streaming chats end (complete, or cut
    cleanly when the front end stops); the process exits 0 without a traceback."""
    served = serve_process("--shutdown-grace-s", "60")
    chats = [ChatReader(served.http, 2000) for _ in range(2)]
    for chat in chats:
        chat.start()
    for chat in chats:
        assert chat.started_streaming.wait(30)
    rid = _start_decode(served.rpc, 1500)
    served.proc.send_signal(signal.SIGTERM)
    text = served.finish()
    for chat in chats:
        chat.join(30)
        assert not chat.is_alive() and chat.ending, chat.ending
    assert served.proc.returncode == 0, text
    assert "Traceback" not in text, text
    assert text.index("received SIGTERM") < text.index(f"decode {rid} done") < text.index("stopped")
    with pytest.raises(httpx.HTTPError):  # and it is gone
        httpx.get(f"http://127.0.0.1:{served.http}/health", timeout=1)


def test_second_signal_during_the_drain_stops_at_once(serve_process: Callable[..., Served]) -> None:
    """A drain with a long grace period; the second SIGTERM cancels the running decode and
    the process exits 0 promptly, without a traceback."""
    served = serve_process("--shutdown-grace-s", "600")
    chat = ChatReader(served.http, 4000)
    chat.start()
    assert chat.started_streaming.wait(30)
    rid = _start_decode(served.rpc, 4000)
    served.proc.send_signal(signal.SIGTERM)
    served.wait_for(lambda: "draining (" in served.text(), 30)
    t0 = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    text = served.finish(30)
    assert time.monotonic() - t0 < 20
    chat.join(30)
    assert not chat.is_alive() and chat.ending
    assert served.proc.returncode == 0, text
    assert "Traceback" not in text, text
    assert f"decode {rid} done" not in text  # it was stopped, not drained
    assert text.index("received SIGTERM") < text.index("stopped")
