"""Soak: `python -m benchmarks.soak --minutes N` (loopback only; stops by itself).

Starts a `hydra-trio serve` process (tiny synthetic model, 20 slots) and drives it for N
minutes with 64 RPC connections: 16 decode workers (4 connections each, one slot each, so 16
decodes run at once) plus 4 streaming or buffered chat workers. Each decode worker picks, at
random: read the result, stream it over SSE, leave the SSE stream midway, DELETE it after a
random delay, hang up right after the ack, or hang up (FIN or reset) before the ack; a hung-up
connection is replaced, so 64 stay open. Every wait is bounded (a stuck call is an error of
kind "hang").

At the end: the workers stop, every connection closes, the engine is given 30 s to settle,
then the figures: RSS at start (after a warm-up) and end, stuck slots, running requests,
leftover tasks (the engine's `hydra_trio_tasks` gauge against its value before the load),
open RPC connections (gauge), DELETEd ids that came back, and errors by kind.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from hydra_trio.rpc.client import RpcClient, RpcConnectionClosed, build_decode_frame, decode_call
from hydra_trio.testing.sse_reader import DONE, sse_data
from hydra_trio.wire.errors import Status
from hydra_trio.wire.protocol import Op, encode_request

from .harness import sample_value

DECODERS = 16
CONNS_PER_DECODER = 4  # 16 x 4 = 64 RPC connections
CHATTERS = 4
OP_TIMEOUT_S = 60.0
MESSAGES = [{"role": "user", "content": "tell me about the slot cache engine"}]
ACTIONS = ["read", "sse", "sse_leave", "delete", "hangup_after_ack", "hangup_before_ack", "reset_before_ack"]
WEIGHTS = [4, 3, 2, 3, 1, 1, 1]


@dataclass
class SoakReport:
    minutes: float = 0.0
    actions: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # expected ends: done, cancelled, busy...
    errors: Counter[str] = field(default_factory=Counter)  # by kind
    examples: list[str] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{kind}: {detail[:300]}")


class Soak:
    def __init__(self, rpc_port: int, http_port: int, report: SoakReport, deadline: float, seed: int) -> None:
        self.rpc_port = rpc_port
        self.base = f"http://127.0.0.1:{http_port}"
        self.report = report
        self.deadline = deadline
        self.seed = seed

    async def _connect(self) -> RpcClient:
        return await RpcClient.connect("127.0.0.1", self.rpc_port)

    def _frame(self, rng: random.Random) -> bytes:
        request = {
            "messages": MESSAGES,
            "n_predict": rng.randint(8, 192),
            "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(1 << 30),
        }
        return build_decode_frame(request, b"")

    # ---- decode workers -----------------------------------------------------------------------

    async def decoder(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        slot = index
        conns = [await self._connect() for _ in range(CONNS_PER_DECODER)]
        async with httpx.AsyncClient(base_url=self.base, timeout=OP_TIMEOUT_S) as h:
            try:
                while time.monotonic() < self.deadline:
                    action = rng.choices(ACTIONS, WEIGHTS)[0]
                    self.report.actions[action] += 1
                    i = rng.randrange(len(conns))
                    try:
                        with trio.fail_after(OP_TIMEOUT_S):
                            replace = await self._decode_once(h, conns[i], slot, action, rng)
                    except trio.TooSlowError:
                        self.report.error("hang", f"decode worker {index} action {action}")
                        replace = True
                    except (RpcConnectionClosed, trio.BrokenResourceError, OSError) as exc:
                        self.report.error(f"rpc connection lost: {type(exc).__name__}", f"{action}: {exc}")
                        replace = True
                    except httpx.HTTPError as exc:
                        self.report.error(f"http: {type(exc).__name__}", f"{action}: {exc}")
                        replace = False
                    if replace:
                        await conns[i].aclose()
                        conns[i] = await self._connect()
            finally:
                with trio.CancelScope(shield=True):
                    for c in conns:
                        await c.aclose()

    async def _decode_once(
        self, h: httpx.AsyncClient, c: RpcClient, slot: int, action: str, rng: random.Random
    ) -> bool:
        """One DECODE and what follows; True when the connection must be replaced."""
        data = self._frame(rng)
        if action in ("hangup_before_ack", "reset_before_ack"):
            raw = await trio.open_tcp_stream("127.0.0.1", self.rpc_port)
            if action == "reset_before_ack":
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await raw.send_all(encode_request(Op.DECODE, str(slot).encode(), data))
            await raw.aclose()
            self.report.outcomes["hung up before the ack"] += 1
            # Its slot frees once the server has seen the hang-up: wait for that, bounded.
            await self._slot_free(h, slot)
            return False
        resp = await c.call(decode_call(slot, data), check=False)
        if resp.status == Status.BUSY:
            self.report.outcomes[f"busy: {resp.meta.get('error_code')}"] += 1  # a chat holds the slot
            await trio.sleep(rng.uniform(0.01, 0.1))
            return False
        if resp.status != Status.OK:
            self.report.error(f"decode refused: {resp.meta.get('error_code')}", str(resp.meta))
            return False
        rid = int(resp.meta["decode_request_id"])
        if action == "hangup_after_ack":
            self.report.outcomes["hung up after the ack"] += 1
            await self._expect_done(h, rid)
            return True
        if action == "read":
            await self._expect_done(h, rid)
        elif action in ("sse", "sse_leave"):
            leave_after = rng.randint(1, 5) if action == "sse_leave" else None
            events, done = 0, False
            async with h.stream("GET", f"/v1/decode/{rid}", headers={"Accept": "text/event-stream"}) as r:
                if r.status_code != 200:
                    self.report.error(f"sse status {r.status_code}", (await r.aread()).decode(errors="replace"))
                    return False
                async for line in r.aiter_lines():
                    if sse_data(line) == DONE:
                        done = True
                    elif sse_data(line) is not None:
                        events += 1
                        if leave_after is not None and events >= leave_after:
                            break
            if leave_after is None and not done:
                self.report.error("sse ended without [DONE]", f"decode {rid} after {events} events")
            elif leave_after is not None:
                self.report.outcomes["left mid-SSE"] += 1
                await self._expect_done(h, rid)  # leaving stopped nothing
            else:
                self.report.outcomes["done (sse)"] += 1
        else:  # delete
            await trio.sleep(rng.uniform(0, 0.2))
            r = await h.delete(f"/v1/decode/{rid}")
            state = r.json().get("state") if r.status_code == 200 else None
            if state == "cancelled":
                self.report.outcomes["cancelled by DELETE"] += 1
                self.report.deleted.append(rid)
            elif state == "deleted":
                self.report.outcomes["deleted after done"] += 1
                self.report.deleted.append(rid)
            else:
                self.report.error(f"delete status {r.status_code}", r.text)
            after = await h.get(f"/v1/decode/{rid}")
            if after.status_code != 410:
                self.report.error("resurrected after DELETE", f"{rid}: {after.status_code} {after.text[:100]}")
        return False

    async def _expect_done(self, h: httpx.AsyncClient, rid: int) -> None:
        r = await h.get(f"/v1/decode/{rid}", params={"wait": OP_TIMEOUT_S - 5})
        if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"):
            self.report.outcomes["done"] += 1
        else:
            self.report.error(f"result status {r.status_code}", f"{rid}: {r.text[:200]}")

    async def _slot_free(self, h: httpx.AsyncClient, slot: int) -> None:
        """Poll over HTTP (bounded by the caller's scope): another process has no event."""
        while True:
            r = await h.get(f"/slots/{slot}/state/meta")
            if r.status_code == 200 and not r.json().get("is_processing"):
                return
            await trio.sleep(0.02)

    # ---- chat workers -------------------------------------------------------------------------

    async def chatter(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + 500 + index)
        async with httpx.AsyncClient(base_url=self.base, timeout=OP_TIMEOUT_S) as h:
            while time.monotonic() < self.deadline:
                stream = rng.random() < 0.7
                leave = stream and rng.random() < 0.3
                body = {
                    "messages": MESSAGES,
                    "max_tokens": rng.randint(8, 160),
                    "temperature": 0.7,
                    "seed": rng.randrange(1 << 30),
                    "stream": stream,
                }
                kind = "chat stream leave" if leave else "chat stream" if stream else "chat"
                self.report.actions[kind] += 1
                try:
                    with trio.fail_after(OP_TIMEOUT_S):
                        await self._chat_once(h, body, leave, rng)
                except trio.TooSlowError:
                    self.report.error("hang", f"chat worker {index}")
                except httpx.HTTPError as exc:
                    self.report.error(f"http: {type(exc).__name__}", f"chat: {exc}")

    async def _chat_once(self, h: httpx.AsyncClient, body: dict[str, Any], leave: bool, rng: random.Random) -> None:
        if not body["stream"]:
            r = await h.post("/v1/chat/completions", json=body)
            if r.status_code == 503:
                self.report.outcomes["chat: all slots busy"] += 1
            elif r.status_code != 200:
                self.report.error(f"chat status {r.status_code}", r.text)
            else:
                self.report.outcomes["chat done"] += 1
            return
        async with h.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 503:
                self.report.outcomes["chat: all slots busy"] += 1
                return
            if r.status_code != 200:
                self.report.error(f"chat status {r.status_code}", (await r.aread()).decode(errors="replace"))
                return
            events, done, leave_after = 0, False, rng.randint(1, 8)
            async for line in r.aiter_lines():
                if sse_data(line) == DONE:
                    done = True
                elif sse_data(line) is not None:
                    events += 1
                    if leave and events >= leave_after:
                        self.report.outcomes["chat left mid-stream"] += 1
                        return
            if done:
                self.report.outcomes["chat stream done"] += 1
            else:
                self.report.error("chat stream ended without [DONE]", f"after {events} events")


def _gauge(text: str, name: str) -> float:
    value = sample_value(text, name)
    return float("nan") if value is None else value


async def _metrics(base: str) -> str:
    # A fresh connection each time, closed after: the same task shape at every scrape.
    async with httpx.AsyncClient(base_url=base, timeout=30) as h:
        return (await h.get("/metrics")).text


async def _settled(base: str, baseline_tasks: float, settle_s: float) -> dict[str, Any]:
    """Wait (bounded) until the engine is back at rest; what is left then."""
    with trio.move_on_after(settle_s):
        while True:
            text = await _metrics(base)
            if (
                _gauge(text, "hydra_decode_requests_running") == 0
                and _gauge(text, "hydra_slots_busy") == 0
                and _gauge(text, "hydra_rpc_connections") == 0
                and _gauge(text, "hydra_trio_tasks") <= baseline_tasks
            ):
                break
            await trio.sleep(0.2)
    text = await _metrics(base)
    return {
        "running_requests": _gauge(text, "hydra_decode_requests_running"),
        "stuck_slots": _gauge(text, "hydra_slots_busy"),
        "open_rpc_connections": _gauge(text, "hydra_rpc_connections"),
        "trio_tasks_before": baseline_tasks,
        "trio_tasks_after": _gauge(text, "hydra_trio_tasks"),
        "orphan_tasks": max(0.0, _gauge(text, "hydra_trio_tasks") - baseline_tasks),
        "tokens_generated": _gauge(text, "hydra_engine_tokens_generated_total"),
    }


async def run_soak(rpc_port: int, http_port: int, *, minutes: float, seed: int, rss: Any) -> SoakReport:
    """Drive the engine for ``minutes``; ``rss()`` reads the engine's resident set size."""
    report = SoakReport(minutes=minutes)
    base = f"http://127.0.0.1:{http_port}"
    baseline = _gauge(await _metrics(base), "hydra_trio_tasks")
    # Warm-up: one decode and one chat, so lazily built things are in the start figure.
    async with await RpcClient.connect("127.0.0.1", rpc_port) as c, httpx.AsyncClient(base_url=base, timeout=60) as h:
        resp = await c.call(decode_call(0, build_decode_frame({"messages": MESSAGES, "n_predict": 16}, b"")))
        await h.get(f"/v1/decode/{resp.meta['decode_request_id']}", params={"wait": 30})
        await h.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16})
    report.figures["rss_mb_start"] = round(rss() / 2**20, 1)
    t0 = time.monotonic()
    soak = Soak(rpc_port, http_port, report, t0 + minutes * 60, seed)
    rss_timeline: list[float] = report.figures.setdefault("rss_mb_each_minute", [])

    async def sample_rss(done: trio.Event) -> None:
        # One sample a minute while the load runs: growth that levels off is the bounded
        # result store filling; growth that does not is a leak.
        while not done.is_set():
            with trio.move_on_after(60):
                await done.wait()
            rss_timeline.append(round(rss() / 2**20, 1))

    with trio.fail_after(minutes * 60 + 2 * OP_TIMEOUT_S + 30):  # the whole run is bounded too
        async with trio.open_nursery() as outer:
            load_done = trio.Event()
            outer.start_soon(sample_rss, load_done)
            async with trio.open_nursery() as nursery:
                for i in range(DECODERS):
                    nursery.start_soon(soak.decoder, i)
                for j in range(CHATTERS):
                    nursery.start_soon(soak.chatter, j)
            load_done.set()
    report.figures["load_s"] = round(time.monotonic() - t0, 1)
    report.figures.update(await _settled(base, baseline, settle_s=30))
    async with httpx.AsyncClient(base_url=base, timeout=30) as h:
        back = 0
        for rid in report.deleted:
            r = await h.get(f"/v1/decode/{rid}")
            back += r.status_code not in (404, 410) or (r.status_code == 404 and "state" in r.json())
        report.figures["resurrected_after_delete"] = back
        report.figures["health_status"] = (await h.get("/health")).status_code
        # Finished results kept (bounded: HYDRA_DECODE_RESULT_MAX, TTL): part of the end RSS.
        report.figures["result_store_entries_end"] = len((await h.get("/v1/decode")).json())
    report.figures["rss_mb_end"] = round(rss() / 2**20, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness import EngineProcess
    from hydra_trio.model.synthetic import write_model

    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hydra-soak-") as tmp:
        model = write_model(Path(tmp) / "tiny.gguf", "tiny", seed=0)
        # 64 soak connections plus a few for the final checks.
        engine = EngineProcess(
            str(model), slots=DECODERS + CHATTERS, ctx_size=8192, threads=1, batch_size=64,
            extra=("--max-connections", "72"),
        )
        engine.start(Path(tmp), "engine")
        try:
            report = trio.run(
                lambda: run_soak(
                    engine.rpc_port, engine.http_port, minutes=args.minutes, seed=args.seed, rss=engine.rss_bytes
                )
            )
            alive = engine.proc is not None and engine.proc.poll() is None
        finally:
            engine.stop()
            code = engine.proc.returncode if engine.proc is not None else None
            log_text = engine.log_path.read_text(errors="replace") if engine.log_path else ""
    out = {
        "minutes": args.minutes,
        "connections": DECODERS * CONNS_PER_DECODER,
        "concurrent_decodes": DECODERS,
        "chat_workers": CHATTERS,
        **report.figures,
        "actions": dict(report.actions.most_common()),
        "outcomes": dict(report.outcomes.most_common()),
        "errors_by_kind": dict(report.errors.most_common()),
        "error_examples": report.examples,
        "engine_alive_at_end": alive,
        "engine_exit_code": code,
        "tracebacks_in_log": log_text.count("Traceback"),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    f = report.figures
    clean = (
        not report.errors and f["stuck_slots"] == 0 and f["running_requests"] == 0 and f["orphan_tasks"] == 0
        and f["resurrected_after_delete"] == 0 and alive and code == 0 and out["tracebacks_in_log"] == 0
    )
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
