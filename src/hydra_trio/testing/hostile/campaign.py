"""The actors: HTTP and RPC fuzzers, slow-drip senders, stalled readers, idle connections,
the shapes, each alone in the solo phase."""

from __future__ import annotations

import json
import random
import socket
import struct
import time
from collections import Counter
from typing import Any

import httpx
import trio

from .. import rpcframes as frames
from .. import rpcfuzz as fuzz
from ..process import EngineProcess
from .campaign_config import Config, Ledger
from .httpfuzz import JSON_ROUTES, Case, check_reply, fuzz_case
from .rawhttp import Reply, _recv, _ServerClosed, http_request, read_reply
from .shapes import CampaignShapes
from .surfaces import id_prediction, own_engine_probes


class Campaign(CampaignShapes):
    """The actors, run together by run.run (the shapes and traps: shapes.CampaignShapes)."""

    def __init__(self, engine: EngineProcess, cfg: Config, ledger: Ledger) -> None:
        self.engine = engine
        self.port = engine.http_port
        self.cfg = cfg
        self.ledger = ledger
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg.duration_s
        self.end = self.deadline + cfg.solo_s  # the solo phase's end, and the streams'
        self.crashed = trio.Event()

    def running(self) -> bool:
        return time.monotonic() < self.deadline and not self.crashed.is_set()

    async def _connect(self, what: str) -> trio.SocketStream | None:
        """A new connection to the engine, or None (a finding) when it cannot be made."""
        try:
            return await trio.open_tcp_stream("127.0.0.1", self.port)
        except OSError as exc:
            self.ledger.find("connect_failed", f"{what}: {exc}")
            return None

    async def exchange(self, kind: str, case: Case, *, sender: Any = None) -> Reply | None:
        """Send a raw request on a new connection, read its one reply (bounded by hang_s once
        sent), check it; the span goes into the ledger."""
        t0 = time.monotonic()
        outcome = "?"
        stream = await self._connect(kind)
        if stream is None:
            self.ledger.record(kind, "connect_failed", t0)
            return None
        reply = None
        sent = False
        try:
            async with stream:
                try:
                    if sender is not None:
                        await sender(stream)
                    else:
                        await stream.send_all(case.data)
                    if case.half_close:
                        await stream.send_eof()
                    sent = True
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass  # the server stopped reading (a refusal before the whole body): read what it said
                with trio.move_on_after(self.cfg.hang_s) as scope:
                    try:
                        reply = await read_reply(stream, head_only=case.data.startswith(b"HEAD "))
                        outcome = str(reply.status)
                    except _ServerClosed:
                        # Closed while we still sent: the server refused early, and its reply
                        # may have been lost to the reset our unread bytes cause. Not a finding.
                        outcome = "closed" if sent else "closed_while_sending"
                    except (ValueError, IndexError) as exc:
                        outcome = "malformed"
                        self.ledger.find("malformed_reply", f"{kind}: {exc}")
                if scope.cancelled_caught:
                    outcome = "HANG"
                    self.ledger.find(
                        "hang",
                        f"{kind}: no reply within {self.cfg.hang_s:g} s ({case.data[:160]!r})",
                    )
        finally:
            self.ledger.record(kind, outcome, t0)
        if reply is not None:
            if outcome == "closed" and not case.protocol:
                self.ledger.find("closed_without_reply", f"{kind}: {case.data[:160]!r}")
            problem = check_reply(case, reply)
            if problem:
                self.ledger.find(
                    "server_error" if reply.status >= 500 else "malformed_reply",
                    f"{kind}: {problem} <- {case.data[:240]!r}",
                )
        elif outcome == "closed" and not case.protocol:
            self.ledger.find("closed_without_reply", f"{kind}: {case.data[:160]!r}")
        return reply

    # ---- actors ----

    async def http_fuzzer(self, index: int) -> None:
        rng = random.Random(self.cfg.seed * 7919 + index)
        n = 0
        # Until the deadline, and at least min_fuzz_requests (the CI form: the same cases
        # however loaded the machine is).
        while self.running() or (n < self.cfg.min_fuzz_requests and not self.crashed.is_set()):
            n += 1
            case = fuzz_case(rng, self.port)
            method, path, *mutation = case.kind.split(" ")
            reply = await self.exchange(f"fuzz {method} {path.split('?')[0]}", case)
            # By mutation too (the route's count above has the span): which shapes get what.
            self.ledger.counts[
                f"mutation {'/'.join(mutation)} {reply.status if reply else 'none'}"
            ] += 1

    async def rpc_fuzzer(self, seeds: frames.Seeds) -> None:
        remaining = max(1.0, self.deadline - time.monotonic())
        try:
            report = await self._rpc_campaign(seeds, remaining)
        except (OSError, httpx.HTTPError) as exc:  # the engine went away under it
            self.ledger.find("rpc_fuzzer_lost_engine", f"{type(exc).__name__}: {exc}")
            return
        self._rpc_report(report)

    async def _rpc_campaign(self, seeds: frames.Seeds, remaining: float) -> fuzz.FuzzReport:
        return await fuzz.run_campaign(
            self.engine.rpc_port,
            self.port,
            frames=self.cfg.rpc_frames or 10**9,
            seed=self.cfg.seed,
            # A frame count (the CI form) is not cut short by the clock on a loaded machine.
            time_limit_s=remaining if not self.cfg.rpc_frames else remaining + 120,
            hang_s=self.cfg.hang_s,
            final_health=False,
            seeds=seeds,
        )

    def _rpc_report(self, report: fuzz.FuzzReport) -> None:
        self.ledger.notes["rpc_fuzz"] = {
            k: v for k, v in report.as_dict().items() if k not in ("health", "findings")
        }
        for what, items in (
            ("rpc_internal", report.internal_errors),
            ("hang", report.hangs),
            ("rpc_desync", report.desyncs),
        ):
            for item in items:
                self.ledger.find(what, f"rpc: {item}")
        for rid in report.resurrected:
            self.ledger.find("rpc_resurrected", f"decode {rid}")
        self.ledger.counts["rpc frames"] += report.frames

    async def dripper(self, index: int) -> None:
        """Requests sent a byte at a time (the request line and headers, or the body, or all);
        the reply must then come. Every fourth is a slowloris that never finishes its headers:
        the server may close it (a minimum rate), or hold it to the end."""
        rng = random.Random(self.cfg.seed * 31 + index)
        gap = self.cfg.drip_interval_s
        while self.running():
            path = rng.choice(
                ["/tokenize", "/v1/completions", "/v1/chat/completions", "/detokenize"]
            )
            body = json.dumps(JSON_ROUTES[path]).encode()
            data = http_request(
                "POST", path, body, [("Content-Type", "application/json")], port=self.port
            )
            mode = rng.choice(["all", "head", "body", "slowloris"])
            split = data.index(b"\r\n\r\n") + 4

            async def send(
                stream: trio.SocketStream, data: bytes = data, mode: str = mode, split: int = split
            ) -> None:
                if mode == "slowloris":
                    for b in data[: split - 10]:
                        if not self.running():
                            return
                        await stream.send_all(bytes([b]))
                        await trio.sleep(gap * 20)
                    raise trio.BrokenResourceError  # gave up: nothing more to read
                drip = data if mode == "all" else data[:split] if mode == "head" else data[split:]
                if mode == "body":
                    await stream.send_all(data[:split])
                for b in drip:
                    await stream.send_all(bytes([b]))
                    await trio.sleep(gap)
                if mode == "head":
                    await stream.send_all(data[split:])

            kind = f"drip_{mode}"
            if mode == "slowloris":
                await self._slowloris(kind, send)
            else:
                await self.exchange(kind, Case(kind, data), sender=send)

    async def _slowloris(self, kind: str, send: Any) -> None:
        t0 = time.monotonic()
        stream = await self._connect(kind)
        if stream is None:
            await trio.sleep(0.5)
            return
        async with stream:
            try:
                await send(stream)
                outcome = "held_to_end"
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                outcome = "closed_by_server" if self.running() else "held_to_end"
        self.ledger.record(kind, outcome, t0)

    async def stalled_reader(self, index: int) -> None:
        """A stream (or a state snapshot) started and never read: a small receive buffer,
        held ``stall_s``, then dropped (FIN or reset)."""
        rng = random.Random(self.cfg.seed * 131 + index)
        while self.running():
            what = rng.choice(["completion_sse", "chat_sse", "state_get"])
            if what == "state_get":
                data = http_request("GET", "/slots/0/state", port=self.port)
            else:
                path = "/v1/completions" if what == "completion_sse" else "/v1/chat/completions"
                body = {**JSON_ROUTES[path], "max_tokens": 1500, "ignore_eos": True, "stream": True}
                data = http_request(
                    "POST",
                    path,
                    json.dumps(body).encode(),
                    [("Content-Type", "application/json")],
                    port=self.port,
                )
            t0 = time.monotonic()
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            try:
                await sock.connect(("127.0.0.1", self.port))
            except OSError as exc:
                sock.close()
                self.ledger.find("connect_failed", f"stalled reader: {exc}")
                await trio.sleep(0.5)
                continue
            stream = trio.SocketStream(sock)
            reset = rng.random() < 0.5
            try:
                await stream.send_all(data)
                await trio.sleep(min(self.cfg.stall_s, max(0.0, self.deadline - time.monotonic())))
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (trio.BrokenResourceError, OSError):
                pass
            finally:
                await stream.aclose()
            self.ledger.record(f"stalled_{what}", "reset" if reset else "fin", t0)

    async def idle_connections(self) -> None:
        """``idle_connections`` connections that send nothing (a tenth send half a request
        line), held to the end; one the server closes is counted and opened again."""
        n = self.cfg.idle_connections
        closed_after: list[float] = []
        answers: Counter[str] = Counter()
        opened = 0

        async def hold(i: int) -> None:
            nonlocal opened
            while self.running():
                t0 = time.monotonic()
                stream = await self._connect("idle connection")
                if stream is None:
                    await trio.sleep(1)
                    continue
                opened += 1
                async with stream:
                    if i % 10 == 0:
                        await stream.send_all(b"GET /heal")
                    with trio.move_on_after(
                        self.deadline - time.monotonic()
                    ):  # (trio's clock is not monotonic()'s)
                        data = await _recv(stream)
                        closed_after.append(time.monotonic() - t0)
                        if data:  # an answer to nothing: what the server says to an idle peer
                            answers[data.split(b"\r\n", 1)[0].decode("latin-1")[:40]] += 1
                if self.running():
                    await trio.sleep(1.0)  # then a new idle one takes its place

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(hold, i)
        self.ledger.notes["idle_connections"] = {
            "held": n,
            "opened": opened,
            "ended_by_server": len(closed_after),
            "answers": dict(answers),
            "closed_after_s_min": round(min(closed_after), 1) if closed_after else None,
            "closed_after_s_max": round(max(closed_after), 1) if closed_after else None,
        }

    async def surfaces(self) -> None:
        """Issue 50's probes: decode ids that must not predict one another (here), and auth
        roles, a reply nested 1,000 deep and cache salts (on an engine of their own)."""
        try:
            await id_prediction(self.ledger, self.engine.rpc_port, self.engine.url, self.cfg.hang_s)
        except (OSError, httpx.HTTPError) as exc:
            self.ledger.find("decode_ids_missing", f"{type(exc).__name__}: {exc}")
        await own_engine_probes(self.ledger, self.cfg.hang_s)

    async def shapes(self) -> None:
        """The issue's shapes, one at a time, round robin."""
        shapes = self._shape_cases()
        i = 0
        # Every shape at least once, even in a short run (then until the deadline).
        while (self.running() or i < len(shapes)) and not self.crashed.is_set():
            kind, case = shapes[i % len(shapes)]
            i += 1
            await self._shape(kind, case)
            await trio.sleep(self.cfg.shape_pause_s)

    async def _shape(self, kind: str, case: Case, label: str = "") -> None:
        label = label + kind
        if kind == "kv_params_fuzz":
            await self.kv_params_fuzz(label)
        elif kind.startswith("kv_pull"):
            await self.kv_pull(kind, label)
        elif kind == "chunked_over_limit":
            # protocol: the 413 may be lost to the reset of our unread upload; a close is fine
            await self.exchange(label, Case(label, b"", protocol=True), sender=self._chunked_sender)
        else:
            await self.exchange(label, case)

    async def solo(self) -> None:
        """After the mixed load: each shape, and the heaviest fuzz bodies, alone beside the
        streams (0.5 s apart), so the delay one request causes is seen unmixed."""
        for kind, case in [*self._shape_cases(), *self._solo_fuzz_cases()]:
            if time.monotonic() > self.end - 3 or self.crashed.is_set():
                self.ledger.counts[f"solo {kind} skipped(no time)"] += 1
                continue
            await trio.sleep(0.5)
            await self._shape(kind, case, "solo ")
