"""Live RPC fuzz campaign: malformed and mutated requests on persistent connections, every
reply read (spec §1 rules 1-4, §4).

Unlike tests/rpc/test_rpc_fuzz.py (one request per connection, then a half-close), the
connection stays open: a PREFILL or DECODE that passes the prechecks runs for real, a DECODE
that is accepted generates and is then read or DELETEd over HTTP, and the next request on the
same connection shows whether the stream stayed in step.

Two sources of frames, in alternating blocks:
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

from ..rpc.client import RpcClient, build_decode_frame, identity_kv_metadata
from ..wire.errors import Status
from ..wire.frames import encode_decode_frame_simple, encode_v3_raw
from ..wire.hashing import xxh3_tag
from ..wire.protocol import (
    MAGIC,
    REQUEST_HEADER,
    RESPONSE_HEADER,
    Op,
    encode_request,
    parse_response_header,
)
from .health import MESSAGES, decode_ends, engine_health

OPS = [int(op) for op in Op] + [0x00, 0x2F, 0x47, 0xFF]
STATUSES = {int(s) for s in Status}
INTERESTING = [
    None, True, False, 0, -1, 1, 3, 2**31, -(2**31), 2**63, 2**64, 1e308, -0.5, "", "x",
    "0", "xxh3:0000000000000000", "\u0000", "é" * 3, [], {}, [None], {"": 1},
    "a" * 300,
]
PROBE_EVERY = 25  # an INFO on the same connection every this many frames: still in step?
BLOCK = 100  # frames per block; blocks alternate between mutation and hypothesis


@dataclass
class Request:
    op: int
    key: bytes
    payload: bytes
    trace: bytes = b""
    flags: int = 0
    magic: int = MAGIC

    def encode(self) -> bytes:
        head = REQUEST_HEADER.pack(
            self.magic, self.op, self.flags, len(self.key), len(self.payload), len(self.trace)
        )
        return b"".join((head, self.key, self.trace, self.payload))


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


# ---- frames -----------------------------------------------------------------------------------


@dataclass
class Seeds:
    """Valid requests captured from the engine, and what they were built from."""

    requests: list[Request]
    blob: bytes  # a PREFILL blob (v2, with logits)
    kv_metadata: dict[str, Any]
    decode_header: dict[str, Any]


async def capture_seeds(rpc_port: int) -> Seeds:
    async with await RpcClient.connect("127.0.0.1", rpc_port) as c:
        pre = await c.prefill(1, {"messages": MESSAGES})
        blob = bytes(pre.payload)
        kv_metadata = identity_kv_metadata(pre.meta, pre.meta["n_past"])
    chat = {"messages": MESSAGES, "n_predict": 4, "temperature": 0}
    header = {
        "v": 3,
        "model": "",
        "kv_metadata": kv_metadata,
        "model_metadata": kv_metadata,
        "generation": {"n_predict": 4, "stream": False},
    }
    requests = [
        Request(Op.INFO, b"", b""),
        Request(Op.STATE_META, b"0", b""),
        Request(Op.STATE_GET, b"1", b""),
        Request(Op.CONFIGURE, b"1", json.dumps({"n_predict": 3, "sampling": {"temperature": 0}}).encode()),
        Request(Op.PREFILL, b"0", json.dumps({"messages": MESSAGES}).encode()),
        Request(Op.STATE_PUT, b"1", blob),
        Request(Op.DECODE, b"0", build_decode_frame(chat, blob, kv_metadata=kv_metadata)),
        Request(Op.DECODE, b"1", build_decode_frame(chat, b"")),
        Request(Op.DECODE, b"0", build_decode_frame(None, b"", generation={"n_predict": 3})),
        Request(Op.DECODE, b"0", encode_decode_frame_simple({**header, "prompt": MESSAGES}, blob)),
    ]
    return Seeds(requests, blob, kv_metadata, header)


def _replace_somewhere(rng: random.Random, obj: Any, depth: int = 0) -> Any:
    """A copy of a JSON value with one value somewhere replaced (or a key dropped/added)."""
    if isinstance(obj, dict) and obj and depth < 4 and rng.random() < 0.8:
        out = dict(obj)
        key = rng.choice(list(out))
        roll = rng.random()
        if roll < 0.1:
            del out[key]
        elif roll < 0.2:
            out[rng.choice(["n_predict", "stop", "stream", "seed", "messages", "prompt", "v", "x"])] = rng.choice(
                INTERESTING
            )
        else:
            out[key] = _replace_somewhere(rng, out[key], depth + 1)
        return out
    if isinstance(obj, list) and obj and depth < 4 and rng.random() < 0.8:
        out_list = list(obj)
        i = rng.randrange(len(out_list))
        out_list[i] = _replace_somewhere(rng, out_list[i], depth + 1)
        return out_list
    return rng.choice(INTERESTING)


def _deep_decode(rng: random.Random, seeds: Seeds) -> bytes:
    """A DECODE frame with a valid header hash and segment table, one value mutated: it gets
    past the frame checks into validation, restore and generation."""
    header = _replace_somewhere(rng, seeds.decode_header) if rng.random() < 0.6 else dict(seeds.decode_header)
    chat: Any = {"messages": MESSAGES, "n_predict": rng.choice([1, 4, 16]), "temperature": 0}
    if rng.random() < 0.6:
        chat = _replace_somewhere(rng, chat)
    prompt = (
        json.dumps(chat).encode() if rng.random() < 0.9 else bytes(rng.randrange(256) for _ in range(rng.randrange(8)))
    )
    kv = rng.choice([seeds.blob, b"", seeds.blob[: rng.randrange(1, len(seeds.blob))]])
    if kv and rng.random() < 0.2:
        flipped = bytearray(kv)
        flipped[rng.randrange(min(len(kv), 64))] ^= 1 << rng.randrange(8)
        kv = bytes(flipped)
    if not isinstance(header, dict):
        header = {"v": 3, "x": header}
    head = dict(header)
    head.setdefault("v", 3)
    if rng.random() < 0.9:
        head["segments"] = [
            {"id": "prompt", "offset": 0, "len": len(prompt), "hash": xxh3_tag(prompt) if rng.random() < 0.7 else ""},
            {
                "id": "kv",
                "offset": len(prompt),
                "len": len(kv),
                "hash": xxh3_tag(kv) if kv and rng.random() < 0.7 else "",
            },
        ]
    header_json = json.dumps(head, separators=(",", ":")).encode()
    return encode_v3_raw(header_json, prompt + kv)


def mutate(rng: random.Random, seeds: Seeds) -> Request:
    base = rng.choice(seeds.requests)
    req = Request(base.op, base.key, base.payload, base.trace)
    kind = rng.randrange(12)
    if kind in (0, 1) and req.payload:  # bit flips in the payload
        b = bytearray(req.payload)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        req.payload = bytes(b)
    elif kind == 2:  # another op, same body
        req.op = rng.choice(OPS)
    elif kind == 3:  # flags
        req.flags = rng.randrange(1, 256)
    elif kind == 4 and req.payload:  # truncated payload (the header says so too)
        req.payload = req.payload[: rng.randrange(len(req.payload))]
    elif kind == 5:  # extended payload
        req.payload = req.payload + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif kind == 6:  # another key
        req.key = (
            rng.choice([b"", b"0", b"1", b"2", b"-1", b" 1", b"01", b"99999999999999999999", b"x"])
            if rng.random() < 0.7
            else rng.randbytes(rng.randrange(1, 9))
        )
    elif kind == 7:  # a trace id, possibly not UTF-8
        req.trace = rng.randbytes(rng.randrange(1, 300))
    elif kind == 8:  # splice two valid payloads
        other = rng.choice(seeds.requests).payload
        cut = rng.randrange(len(req.payload) + 1)
        req.payload = req.payload[:cut] + other[rng.randrange(len(other) + 1) :]
    elif kind in (9, 10):  # structured DECODE mutation (valid hashes)
        req = Request(Op.DECODE, rng.choice([b"0", b"1"]), _deep_decode(rng, seeds))
    elif kind == 11 and rng.random() < 0.3:  # bad magic: the server closes without a reply
        req.magic = rng.randrange(1 << 16)
        if req.magic == MAGIC:
            req.magic ^= 1
    return req


def hypothesis_requests(seeds: Seeds) -> Any:
    """A hypothesis strategy of whole requests."""
    from hypothesis import strategies as st

    scalars = (
        st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False) | st.text(max_size=12)
    )
    values = st.recursive(
        scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | st.text(max_size=5) | values,
            "content": st.text(max_size=40) | values,
        }
    )
    chat = st.fixed_dictionaries(
        {},
        optional={
            "messages": st.lists(message, max_size=3) | values,
            "prompt": st.text(max_size=40) | values,
            "n_predict": st.integers(-3, 64) | values,
            "max_tokens": st.integers(-3, 64) | values,
            "temperature": st.floats(-1, 3) | values,
            "seed": st.integers(-(2**40), 2**40),
            "stop": st.lists(st.text(max_size=4), max_size=3) | values,
            "stream": st.booleans() | values,
            "tools": values,
            "add_generation_prompt": values,
        },
    )
    ident = seeds.kv_metadata
    kv_meta = st.fixed_dictionaries({}, optional={k: st.just(v) | values for k, v in ident.items()})
    header = st.fixed_dictionaries(
        {"v": st.just(3) | values},
        optional={
            "model": st.just("") | values,
            "kv_metadata": kv_meta | values,
            "model_metadata": kv_meta,
            "generation": chat | values,
        },
    )
    blob = seeds.blob
    kvs = st.sampled_from([b"", blob]) | st.binary(max_size=64) | st.integers(1, len(blob) - 1).map(lambda n: blob[:n])

    def v3(parts: tuple[dict[str, Any], Any, bytes, bool]) -> bytes:
        head, prompt, kv, hashed = parts
        raw = json.dumps(prompt).encode() if not isinstance(prompt, bytes) else prompt
        head = {
            **head,
            "segments": [
                {"id": "prompt", "offset": 0, "len": len(raw), "hash": xxh3_tag(raw) if hashed and raw else ""},
                {"id": "kv", "offset": len(raw), "len": len(kv), "hash": xxh3_tag(kv) if hashed and kv else ""},
            ],
        }
        try:
            header_json = json.dumps(head, separators=(",", ":")).encode()
        except ValueError:  # a float hypothesis made JSON cannot carry: send it as text
            header_json = repr(head).encode()
        return encode_v3_raw(header_json, raw + kv)

    decode_frames = st.tuples(header, chat | values | st.binary(max_size=32), kvs, st.booleans()).map(v3)
    keys = st.sampled_from([b"0", b"1", b"", b"2", b"-1", b"abc"]) | st.binary(max_size=6)

    def encode_json(v: Any) -> bytes:
        try:
            return json.dumps(v).encode()
        except ValueError:
            return repr(v).encode()

    payloads = {
        Op.DECODE: decode_frames,
        Op.PREFILL: (chat | values).map(encode_json),
        Op.CONFIGURE: st.fixed_dictionaries(
            {},
            optional={
                "n_predict": values,
                "seed": values,
                "n_keep": values,
                "antiprompt": values,
                "sampling": values,
                "state_chunk_size": values,
            },
        ).map(encode_json)
        | values.map(encode_json),
        Op.STATE_PUT: kvs,
    }
    ops = st.sampled_from(OPS)
    return ops.flatmap(
        lambda op: st.builds(
            Request,
            st.just(op),
            keys,
            payloads.get(op, st.binary(max_size=16)) if op in payloads else st.binary(max_size=16),
            st.binary(max_size=8),
            st.just(0) | st.integers(0, 255),
        )
    )


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
