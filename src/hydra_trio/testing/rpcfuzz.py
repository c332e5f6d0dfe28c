"""Live RPC fuzz campaign: malformed and mutated requests on persistent connections, every
reply read (spec §1 rules 1-4, §4).

Unlike tests/rpc/test_rpc_fuzz.py (one request per connection, then a half-close), the
connection stays open: a PREFILL or DECODE that passes the prechecks runs for real, a DECODE
that is accepted generates and is then read or DELETEd over HTTP, and the next request on the
same connection shows whether the stream stayed in step.

Two sources of frames (testing/rpcframes.py makes them), in alternating blocks:
- mutation of valid frames captured from the engine (bit flips, op and key swaps, flags,
  truncated or extended payloads, splices, bad magic), plus structured mutation of DECODE
  frames: one header or prompt value replaced, the header hash and segment table recomputed,
  so the frame gets past the hash checks into validation, restore and generation;
- hypothesis strategies: whole requests built from JSON values, chat requests, DECODE
  headers (identity, generation, segments) and KV blobs.

Every frame is self-consistent (the lengths in its header are the bytes sent), so a correct
server answers with exactly one well-formed reply, or closes the connection only for bad
magic. Findings: an op's unexpected exception (``INTERNAL``), a hang (no reply within
``hang_s``), a desync (malformed reply, stray bytes, a close after good magic, a failed sync
probe), a resurrected decode entry, and the engine's health afterwards.

``python -m benchmarks.fuzz --frames 100000 --minutes 10`` starts its own engine (a
``hydra-trio serve`` process on loopback, tiny synthetic model) and stops by itself at
whichever limit comes first. Tests call ``run_campaign`` against an in-process engine; the
hostile campaign (testing/hostile/) runs it beside its HTTP actors.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from ..wire.errors import Status
from ..wire.protocol import (
    MAGIC,
    RESPONSE_HEADER,
    Op,
    encode_request,
    parse_response_header,
)
from .health import decode_ends, engine_health
from .rpcframes import Request, Seeds, capture_seeds, hypothesis_requests, mutate

STATUSES = {int(s) for s in Status}
PROBE_EVERY = 25  # an INFO on the same connection every this many frames: still in step?
BLOCK = 100  # frames per block; blocks alternate between mutation and hypothesis


@dataclass
class FuzzReport:
    frames: int = 0
    by_source: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # "OK", "BAD_REQUEST/BAD_FRAME", "closed"
    by_op: Counter[str] = field(default_factory=Counter)
    internal_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    desyncs: list[str] = field(default_factory=list)
    resurrected: list[int] = field(default_factory=list)
    probes: int = 0
    reconnects: int = 0
    decodes_accepted: int = 0
    decode_ends: Counter[str] = field(default_factory=Counter)  # done / cancelled / failed ...
    decode_failures: Counter[str] = field(default_factory=Counter)  # reason codes after the ack
    health: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def findings(self) -> int:
        unhealthy = 0 if self.health.get("ok") else 1
        return (
            len(self.internal_errors) + len(self.hangs) + len(self.desyncs)
            + len(self.resurrected) + unhealthy
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "elapsed_s": round(self.elapsed_s, 1),
            "frames_per_s": round(self.frames / self.elapsed_s, 1) if self.elapsed_s else 0.0,
            "by_source": dict(self.by_source),
            "outcomes": dict(self.outcomes.most_common()),
            "by_op": dict(self.by_op.most_common()),
            "internal_errors": len(self.internal_errors),
            "hangs": len(self.hangs),
            "desyncs": len(self.desyncs),
            "resurrected": len(self.resurrected),
            "probes": self.probes,
            "reconnects": self.reconnects,
            "decodes_accepted": self.decodes_accepted,
            "decode_ends": dict(self.decode_ends),
            "decode_failures": dict(self.decode_failures),
            "health": self.health,
            "findings": self.findings,
            "examples": (self.internal_errors + self.hangs + self.desyncs)[:10],
        }


# ---- the wire, from the client's side ---------------------------------------------------------


class _Closed(Exception):
    """The server closed (or reset) the connection."""


class _Desync(Exception):
    """The server sent something that is not one well-formed reply."""


class Wire:
    """One persistent connection; reads whole replies, checks their shape."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    @classmethod
    async def connect(cls, port: int) -> Wire:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _Closed(str(exc)) from None

    async def _fill(self, n: int, *, at_start: bool) -> None:
        while len(self.buf) < n:
            try:
                chunk = await self.stream.receive_some(max(1 << 16, n - len(self.buf)))
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                if at_start and not self.buf:
                    raise _Closed("closed")
                raise _Desync(f"closed mid-reply after {len(self.buf)}/{n} bytes")
            self.buf += chunk

    async def _take(self, n: int, *, at_start: bool = False) -> bytes:
        await self._fill(n, at_start=at_start)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def reply(self) -> tuple[int, dict[str, Any], int]:
        """(status, meta, payload length) of the next reply; _Closed or _Desync."""
        head = parse_response_header(await self._take(RESPONSE_HEADER.size, at_start=True))
        if head.status not in STATUSES:
            raise _Desync(f"unknown status 0x{head.status:02x}")
        raw = await self._take(head.meta_len)
        try:
            meta = json.loads(raw) if raw else {}
        except ValueError:
            raise _Desync(f"meta is not JSON: {raw[:60]!r}") from None
        if not isinstance(meta, dict):
            raise _Desync(f"meta is not an object: {raw[:60]!r}")
        if head.status != Status.OK and not (
            isinstance(meta.get("error"), str) and isinstance(meta.get("error_code"), str)
        ):
            raise _Desync(f"error reply without error fields: {meta}")
        await self._take(head.payload_len)
        return head.status, meta, head.payload_len

    def stray(self) -> bytes:
        return bytes(self.buf)


# ---- the campaign -----------------------------------------------------------------------------


class Campaign:
    def __init__(
        self, rpc_port: int, http_port: int, seeds: Seeds, report: FuzzReport, *, hang_s: float, seed: int
    ) -> None:
        self.rpc_port = rpc_port
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=hang_s)
        self.seeds = seeds
        self.report = report
        self.hang_s = hang_s
        self.rng = random.Random(seed)
        self.wire: Wire | None = None
        self.deleted: list[int] = []

    async def _wire(self) -> Wire:
        if self.wire is None:
            self.wire = await Wire.connect(self.rpc_port)
        return self.wire

    async def _drop(self) -> None:
        if self.wire is not None:
            await self.wire.aclose()
            self.wire = None
            self.report.reconnects += 1

    async def exchange(self, req: Request, source: str) -> None:
        """Send one request on the persistent connection and read its one reply."""
        report = self.report
        report.frames += 1
        report.by_source[source] += 1
        report.by_op[_op_name(req.op)] += 1
        what = f"{source} {_op_name(req.op)} key={req.key[:12]!r} flags={req.flags} len={len(req.payload)}"
        wire = await self._wire()
        try:
            with trio.fail_after(self.hang_s):
                await wire.send(req.encode())
                status, meta, _ = await wire.reply()
        except trio.TooSlowError:
            report.hangs.append(what)
            await self._drop()
            return
        except _Closed:
            report.outcomes["closed"] += 1
            if req.magic == MAGIC:
                report.desyncs.append(f"closed without a reply after good magic: {what}")
            await self._drop()
            return
        except _Desync as exc:
            report.desyncs.append(f"{exc}: {what}")
            await self._drop()
            return
        if req.magic != MAGIC:
            report.desyncs.append(f"a reply to bad magic: {what}")
        label = Status(status).name if status == Status.OK else f"{Status(status).name}/{meta['error_code']}"
        report.outcomes[label] += 1
        if meta.get("error_code") == "INTERNAL":
            report.internal_errors.append(f"{meta['error']}: {what}")
        if status == Status.OK and req.op == Op.DECODE:
            report.decodes_accepted += 1
            await self._settle(int(meta["decode_request_id"]))
        if report.frames % PROBE_EVERY == 0:
            await self.probe()

    async def probe(self) -> None:
        """INFO on the same connection: the stream is still in step."""
        wire = await self._wire()
        self.report.probes += 1
        try:
            with trio.fail_after(self.hang_s):
                await wire.send(encode_request(Op.INFO))
                status, meta, _ = await wire.reply()
        except (trio.TooSlowError, _Closed, _Desync) as exc:
            self.report.desyncs.append(f"sync probe failed: {type(exc).__name__} {exc}")
            await self._drop()
            return
        if status != Status.OK or meta.get("engine") != "hydra-trio":
            self.report.desyncs.append(f"sync probe answered {status} {meta}")

    async def _settle(self, rid: int) -> None:
        """An accepted DECODE: read its result (briefly) or DELETE it, so the slots free up."""
        r = await self.http.get(f"/v1/decode/{rid}", params={"wait": self.rng.choice([0, 0.5])})
        if r.status_code == 400:  # it failed after the ack: why?
            reason = r.json().get("reason_code") or "?"
            self.report.decode_failures[reason] += 1
            if reason == "INTERNAL":
                self.report.internal_errors.append(f"decode {rid} failed: {r.json()['error']['message']}")
            return
        if r.status_code != 404 or r.json().get("state") != "generating":
            return
        r = await self.http.delete(f"/v1/decode/{rid}")
        if r.status_code == 200 and r.json().get("state") == "cancelled":
            self.deleted.append(rid)

    async def check_no_resurrection(self) -> None:
        for rid in self.deleted:
            r = await self.http.get(f"/v1/decode/{rid}")
            if r.status_code not in (404, 410) or (r.status_code == 404 and "state" in r.json()):
                self.report.resurrected.append(rid)

    async def aclose(self) -> None:
        if self.wire is not None:
            await self.wire.aclose()
        await self.http.aclose()


def _op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"0x{op:02x}"


async def _hypothesis_block(campaign: Campaign, seeds: Seeds, n: int, seed: int, deadline: float) -> None:
    """n hypothesis-drawn requests; hypothesis drives from a worker thread, each example is
    exchanged on the trio side (trio.from_thread.run)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    strategy = hypothesis_requests(seeds)

    @hseed(seed)
    @settings(
        max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def run(req: Request) -> None:
        if time.monotonic() < deadline:
            trio.from_thread.run(campaign.exchange, req, "hypothesis")

    await trio.to_thread.run_sync(run)


async def run_campaign(
    rpc_port: int,
    http_port: int,
    *,
    frames: int,
    seed: int = 0,
    time_limit_s: float = 600.0,
    hang_s: float = 30.0,
    final_health: bool = True,
    seeds: Seeds | None = None,
) -> FuzzReport:
    """Send up to ``frames`` requests (or until ``time_limit_s``) and report; then check the
    engine's health (``final_health``: off when other load still runs beside the fuzzer, as
    in benchmarks/hostile.py, which checks it after everything has stopped; it also passes
    ``seeds`` captured before its load starts, as capturing needs slots 0 and 1 free).
    Loopback only; stops by itself."""
    report = FuzzReport()
    t0 = time.monotonic()
    deadline = t0 + time_limit_s
    if seeds is None:
        seeds = await capture_seeds(rpc_port)
    campaign = Campaign(rpc_port, http_port, seeds, report, hang_s=hang_s, seed=seed)
    try:
        block = 0
        while report.frames < frames and time.monotonic() < deadline:
            n = min(BLOCK, frames - report.frames)
            if block % 2 == 0:
                for _ in range(n):
                    if time.monotonic() >= deadline:
                        break
                    await campaign.exchange(mutate(campaign.rng, seeds), "mutation")
            else:
                await _hypothesis_block(campaign, seeds, n, seed * 100_003 + block, deadline)
            block += 1
        await campaign.probe()
        await campaign.check_no_resurrection()
        report.decode_ends = await decode_ends(campaign.http)
        if final_health:
            report.health = await engine_health(rpc_port, campaign.http)
    finally:
        await campaign.aclose()
    report.elapsed_s = time.monotonic() - t0
    return report


__all__ = ["FuzzReport", "Seeds", "capture_seeds", "engine_health", "run_campaign"]
