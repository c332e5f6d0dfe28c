"""Hostile-client campaign: everything a bad or broken client can send, at once, beside
well-formed streams whose every token's arrival is timed.

    python -m benchmarks.hostile [--duration-s 60] [--short] [--seed 0] [--json PATH]

Starts a ``hydra-trio serve`` process (tiny synthetic model, loopback only; stops by itself)
and runs, together, until ``--duration-s``:

- an HTTP fuzzer over every route (seeded structure-aware mutations of valid bodies: wrong
  types, huge numbers, huge strings, deep nesting, bad UTF-8, lone surrogates, NaN, trailing
  garbage; and of the request around them: content types, bad/duplicate/huge headers,
  Content-Length that lies, broken chunked framing, odd paths and methods), on raw sockets so
  every byte is ours;
- the RPC fuzzer of benchmarks/fuzz.py (run_campaign, reused as is);
- slow-drip senders (request line, headers and body a byte at a time) and stalled readers (a
  stream or a state snapshot started and never read);
- the shapes of issue 22: a 12 MB ``POST /detokenize``, 12 MB prompts to chat, completions,
  tokenize and render, a 4 M-token prompt array, bodies past --max-json-bytes (declared and
  chunked), 200 idle connections, KV pulls aimed at disallowed addresses (a listener on every
  interface, at the port they name, tells whether a connection was opened);
- well-formed streaming ``/v1/completions`` (``ignore_eos``), read in a separate process (so
  the driver's own CPU does not delay their reading), every token stamped with
  CLOCK_MONOTONIC, the clock the driver stamps each hostile request's start and end with.

Reported: requests per kind and status; findings (5xx other than the documented 503/507,
malformed replies, hangs past ``--hang-s``, a crash, outbound connections to disallowed
addresses, tracebacks in the engine's log, the engine's health afterwards); peak RSS against
the budget (model + KV cache + --max-inflight-bytes + --cache-ram-mib + --kv-export-max-bytes
+ RUNTIME_ALLOWANCE_MIB); /health latency; the streams' inter-token gaps (p50/p99/max), each
large gap attributed to the hostile requests in flight during it; then each shape alone
beside the streams (the solo phase: one request's own delay). Writes
benchmarks/results/hostile.json (``--short``: hostile-short.json). Timing goals live here,
never in tests (tests/test_hostile_short.py asserts correctness only).
"""

from __future__ import annotations

import argparse
import json
import random
import selectors
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import trio

from . import fuzz
from .ceiling import Stream, _consume, _request
from .harness import EngineProcess, percentile, words_prompt

RESULTS = Path(__file__).resolve().parent / "results"
DOCUMENTED_5XX = {503, 507}  # busy/draining, and "insufficient storage" (budget) replies
# What the engine may use past model + KV cache + the byte budgets: the Python runtime,
# llama.cpp, Quart and Hypercorn (the tiny model's engine idles at ~80 MB RSS, of which
# model + KV are ~4 MB), with some slack. Request bodies are not in it: that is the point.
RUNTIME_ALLOWANCE_MIB = 96
GOAL_GAP_MS = 250.0
NOTABLE_GAP_MS = 50.0  # gaps above this are attributed to what was in flight
BIG = 12_000_000  # the issue's 12 MB shapes
# Schemas a client may send to size or wedge the grammar (issue 40): each is a 400.
HOSTILE_SCHEMAS: dict[str, Any] = {
    "min_length_1e8": {"type": "string", "minLength": 100_000_000},
    "max_items_1e9": {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000_000},
    "pattern_repeat_1e7": {"type": "string", "pattern": "^a{10000000}$"},
    "lengths_add_up": {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 2000} for i in range(20)}},
    "min_over_max": {"type": "string", "minLength": 5, "maxLength": 2},
    "all_of_string_integer": {"allOf": [{"type": "string"}, {"type": "integer"}]},
    "required_not_allowed": {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
    "pattern_bad_range": {"type": "string", "pattern": "^[z-a]$"},
    "empty_integer_range": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4},
}
MAX_REPLY = 64 << 20  # read at most this much of any reply
MESSAGES = [{"role": "user", "content": "hello world"}]
STOPPED = "stopped: the campaign ended"
# kv_transfer_params fuzzed field by field (issue 28, 1.7): each field of a real export's
# params gets each value in turn. Any of them must give a 200 that falls back (or, for the
# rare one that still names the export, restores), never a 5xx.
KV_PARAM_FIELDS = (
    "remote_host", "remote_port", "hydra", "hydra.v", "hydra.export_id", "hydra.n_past",
    "hydra.kv_hash", "hydra.kv_bytes", "hydra.kv_cache", "hydra.kv_cache.type_k", "hydra.shm",
    "hydra.shm.probe", "hydra.shm.token", "hydra.tokenizer", "hydra.model_name",
)  # fmt: skip
KV_PARAM_VALUES: tuple[Any, ...] = (
    None, True, -1, 0, 2**62, 2**70, 1.5, "", ".", "a..b", "a" * 64, "é" * 300, "x\n2099-01-01 INFO forged",
    "/dev/shm/hydra-kv-0-1-0badcafe-probe\x00", "\udcff", [], {}, {"probe": 1}, ["127.0.0.1"],
)  # fmt: skip
KV_PARAM_REASONS = {
    "bad_params", "not_allowed", "pull_failed", "not_found", "refused", "too_large", "timeout",
    "identity_mismatch", "layout_mismatch", "hash_mismatch", "prompt_mismatch", "restore_failed",
}  # fmt: skip
KV_PARAM_BATCH = 12  # mutations per round of the shape, sent together


# ---- what happened -----------------------------------------------------------------------


@dataclass
class Ledger:
    """Every hostile request: its kind, outcome and time span; and the findings."""

    counts: Counter[str] = field(default_factory=Counter)  # "kind status"
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # kind, t0, t1 (monotonic)
    findings: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    health_ms: list[float] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def record(self, kind: str, outcome: str, t0: float) -> None:
        self.counts[f"{kind} {outcome}"] += 1
        self.spans.append((kind, t0, time.monotonic()))

    def find(self, what: str, detail: str) -> None:
        if len(self.findings[what]) < 50:
            self.findings[what].append(detail[:400])
        self.counts[f"FINDING {what}"] += 1


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


# ---- the HTTP fuzzer -------------------------------------------------------------------------


@dataclass
class Case:
    kind: str  # route and mutation, for the counts
    data: bytes  # what goes on the wire
    protocol: bool = False  # malformed HTTP: Hypercorn's own bare 4xx, or a close, is fine
    half_close: bool = False  # shut our side after sending (a body that never comes)


JSON_ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4, "temperature": 0},
    "/v1/completions": {"prompt": "hello world", "max_tokens": 4, "temperature": 0, "stop": ["\n"]},
    "/tokenize": {"content": "hello world", "with_pieces": True},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": MESSAGES},
    "/v1/chat/completions/render": {"messages": MESSAGES},
    "/v1/completions/render": {"prompt": "hello world"},
}
OTHER_ROUTES = [
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/slots"),
    ("GET", "/v1/models"),
    ("GET", "/slots/0/state/meta"),
    ("GET", "/slots/1/state"),
    ("GET", "/v1/decode"),
    ("GET", "/v1/decode/1"),
    ("DELETE", "/v1/decode/2"),
    ("POST", "/slots/1?action=erase"),
    ("PUT", "/slots/1/state"),
]
ODD_IDS = ["-1", "99999999999999999999", "abc", "%00", "0x1", "１", "1.5", "", "..", "0" * 5000]
HOSTILE_VALUES: list[Any] = [
    *fuzz.INTERESTING,
    10**30,
    -(10**30),
    2**31 - 1,
    1e-320,
    "\ud800",
    "\udfff\ud800",
    "a\x00b",
    "x" * 100_000,
    ["x"] * 5000,
    {"k" * 1000: 1},
    [[[[[[]]]]]],
    "<|im_start|>",
    "{{ 7*7 }}",
    "{% for x in range(10**9) %}",
]
CONTENT_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "application/json; charset=utf-16",
    "",
    "*/*",
    "application/json\x00",
]


def _replace(rng: random.Random, obj: Any) -> Any:
    """fuzz.py's one-value replacement, then (half the time) a hostile value somewhere."""
    out = fuzz._replace_somewhere(rng, obj)
    if isinstance(out, dict) and rng.random() < 0.5:
        out = dict(out)
        out[
            rng.choice(
                [
                    *out,
                    "stream",
                    "n_predict",
                    "max_tokens",
                    "kv_transfer_params",
                    "tools",
                    "id_slot",
                ]
                or ["x"]
            )
        ] = rng.choice(HOSTILE_VALUES)
    return out


def _dumps(obj: Any) -> bytes:
    # ASCII escapes: a lone surrogate goes out as \\ud800, as any client could send it.
    return json.dumps(obj).encode()


def json_body_mutation(rng: random.Random, seed_body: dict[str, Any]) -> tuple[str, bytes]:
    """A mutated JSON body: (mutation name, bytes)."""
    roll = rng.randrange(16)
    if roll < 5:
        return "value", _dumps(_replace(rng, seed_body))
    if roll == 5:
        depth = rng.choice([100, 5000, 200_000])
        return f"nest{depth}", b'{"x":' + b"[" * depth + b"]" * depth + b"}"
    if roll == 6:
        digits = rng.choice([20, 400, 5000, 50_000])
        key = rng.choice(["max_tokens", "n_predict", "seed", "temperature", "x"])
        return f"bigint{digits}", _dumps(seed_body)[
            :-1
        ] + f',"{key}":'.encode() + b"9" * digits + b"}"
    if roll == 7:
        lit = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0", b"1E400"])
        key = rng.choice(["max_tokens", "temperature", "top_p", "seed", "x"])
        return "literal", _dumps(seed_body)[:-1] + f',"{key}":'.encode() + lit + b"}"
    if roll == 8:
        raw = bytearray(_dumps(seed_body))
        for _ in range(rng.randint(1, 4)):
            raw.insert(rng.randrange(len(raw)), rng.choice([0xFF, 0xC0, 0x80, 0xED, 0xF4, 0x00]))
        return "bad_utf8", bytes(raw)
    if roll == 9:
        raw = _dumps(seed_body)
        return "truncated", raw[: rng.randrange(len(raw))]
    if roll == 10:
        return "trailing", _dumps(seed_body) + rng.choice(
            [b"garbage", b"{}", b"\x00", b" " * 1000, b"]"]
        )
    if roll == 11:
        return "not_object", rng.choice(
            [b"[]", b'"x"', b"1", b"null", b"true", b"", b" ", b"\xef\xbb\xbf{}"]
        )
    if roll == 12:
        dup = _dumps(seed_body)[:-1] + b"," + _dumps(seed_body)[1:]
        return "dup_keys", dup
    if roll == 13:
        return "utf16", json.dumps(seed_body).encode("utf-16")
    if roll == 14:
        key = rng.choice(list(seed_body))
        return "huge_string", _dumps({**seed_body, key: "é" * rng.choice([10_000, 1_000_000])})
    return "kv_params", _dumps(
        {
            **seed_body,
            "kv_transfer_params": rng.choice(
                [
                    *HOSTILE_VALUES,
                    {"do_remote_decode": True},
                    {
                        "do_remote_prefill": True,
                        "remote_host": "127.0.0.1",
                        "remote_port": 1,
                        "hydra": {},
                    },
                    {
                        "hydra": {
                            "v": 1,
                            "op": "KV_PULL",
                            "export_id": "x" * 300,
                            "n_past": -1,
                            "kv_bytes": 2**62,
                        }
                    },
                ]
            ),
        }
    )


def header_mutation(rng: random.Random, method: str, path: str, body: bytes, port: int) -> Case:
    """The request around a body: headers, framing, line. Most stay valid HTTP."""
    roll = rng.randrange(18)
    ct = [("Content-Type", "application/json")]
    if roll < 4:  # odd headers: the app must still answer in JSON (unless a value is not HTTP)
        extra = rng.choice(
            [
                [("Content-Type", rng.choice(CONTENT_TYPES))],
                [("X-Request-Id", "r" * rng.choice([10, 8000])), *ct],
                [("X-Request-Id", "\x7f\x01é"), *ct],
                [
                    (
                        "Authorization",
                        rng.choice(["Bearer", "Bearer " + "x" * 4000, "Basic ???", "bearer\tx"]),
                    ),
                    *ct,
                ],
                [
                    (
                        "Accept",
                        rng.choice(["text/event-stream", "*/*;q=x", "application/xml", "t" * 3000]),
                    ),
                    *ct,
                ],
                [("Content-Encoding", "gzip"), *ct],
                [("Expect", "100-continue"), *ct],
                [*ct, *[(f"X-H{i}", "v") for i in range(80)]],
                [("Content-Type", "application/json"), ("Content-Type", "text/plain")],
            ]
        )
        # A control character makes the value invalid HTTP: Hypercorn's bare 400 is then right.
        bad = any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for _, v in extra for c in v)
        return Case(
            f"{method} {path} hdr", http_request(method, path, body, extra, port=port), protocol=bad
        )
    if roll == 4:  # a valid chunked body
        chunks = (
            b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in _split(rng, body))
            + b"0\r\n\r\n"
        )
        return Case(
            f"{method} {path} chunked",
            http_request(method, path, chunks, [*ct, ("Transfer-Encoding", "chunked")], port=port),
        )
    if roll == 5:  # Content-Length larger than the body, then our side shut: the body never comes
        n = rng.choice([len(body) + 1, 10 << 20, 10**15])
        return Case(
            f"{method} {path} cl_over",
            http_request(method, path, body, [*ct, ("Content-Length", str(n))], port=port),
            protocol=True,
            half_close=True,
        )
    if roll == 6:  # Content-Length smaller: the rest reads as the next request
        n = rng.randrange(max(1, len(body)))
        return Case(
            f"{method} {path} cl_under",
            http_request(method, path, body, [*ct, ("Content-Length", str(n))], port=port),
            protocol=True,
        )
    if roll == 7:
        bad = rng.choice(["-1", "abc", "1e3", "99999999999999999999999", " 12", "0x10"])
        return Case(  # (our EOF: a short body is not left to the upload deadline, drips test that)
            f"{method} {path} cl_bad",
            http_request(method, path, body, [*ct, ("Content-Length", bad)], port=port),
            protocol=True,
            half_close=True,
        )
    if roll == 8:
        return Case(
            f"{method} {path} cl_dup",
            http_request(
                method,
                path,
                body,
                [*ct, ("Content-Length", str(len(body))), ("Content-Length", str(len(body) + 5))],
                port=port,
            ),
            protocol=True,
        )
    if roll == 9:  # chunked and Content-Length at once, or broken chunk framing
        framing = rng.choice(
            [
                [("Transfer-Encoding", "chunked"), ("Content-Length", str(len(body)))],
                [("Transfer-Encoding", "chunked")],
                [("Transfer-Encoding", "gzip, chunked")],
                [("Transfer-Encoding", "identity")],
            ]
        )
        raw = rng.choice(
            [b"zz\r\n" + body + b"\r\n0\r\n\r\n", f"{len(body) + 100:x}\r\n".encode() + body, body]
        )
        return Case(
            f"{method} {path} te_bad",
            http_request(method, path, raw, [*ct, *framing], port=port),
            protocol=True,
            half_close=True,
        )
    if roll == 10:  # a huge header, or many
        extra = rng.choice(
            [
                [("X-Big", "b" * rng.choice([20_000, 200_000]))],
                [(f"X-{i}", "v") for i in range(rng.choice([500, 5000]))],
            ]
        )
        return Case(
            f"{method} {path} hdr_huge",
            http_request(method, path, body, [*ct, *extra], port=port),
            protocol=True,
        )
    if roll == 11:  # header lines that break the grammar
        line = rng.choice(
            [
                b"NoColon",
                b"Bad Name: x",
                b"X: a\x00b",
                b" folded: x",
                b"X:\xff\xfe",
                b":empty",
                b"X: " + b"\r" * 3,
            ]
        )
        raw = http_request(method, path, body, ct, port=port)
        cut = raw.index(b"\r\n") + 2
        return Case(
            f"{method} {path} hdr_grammar", raw[:cut] + line + b"\r\n" + raw[cut:], protocol=True
        )
    if roll == 12:  # the request line
        line = rng.choice(
            [
                f"{method} {path} HTTP/2.0",
                f"{method} {path} HTTP/1.0",
                f"FOO {path} HTTP/1.1",
                f"{method} http://evil.example{path} HTTP/1.1",
                f"{method} {path}",
                f"{method}  {path} HTTP/1.1",
                f"{method} /{'a' * 100_000} HTTP/1.1",
                f"{method} {path}?{'q=1&' * 5000} HTTP/1.1",
            ]
        )
        raw = http_request(method, path, body, ct, port=port)
        return Case(
            f"{method} {path} reqline", line.encode() + raw[raw.index(b"\r\n") :], protocol=True
        )
    if roll == 13:  # no Host
        raw = http_request(method, path, body, ct, port=port).replace(
            f"Host: 127.0.0.1:{port}\r\n".encode(), b""
        )
        return Case(f"{method} {path} no_host", raw, protocol=True)
    if roll == 14:  # odd ids in the path
        odd = rng.choice(ODD_IDS)
        p2 = rng.choice(
            [
                f"/slots/{odd}/state",
                f"/slots/{odd}/state/meta",
                f"/v1/decode/{odd}",
                f"/slots/{odd}?action=erase",
                f"/slots/0?action={odd}",
            ]
        )
        m2 = rng.choice(["GET", "DELETE", "POST", "PUT"])
        return Case(f"{m2} odd_path", http_request(m2, p2.replace(" ", "%20"), b"", ct, port=port))
    if roll == 15:  # the wrong method
        m2 = rng.choice(["GET", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "TRACE"])
        return Case(f"{m2} {path} method", http_request(m2, path, body, ct, port=port))
    if roll == 16:  # no body at all, or a body on a GET
        return Case(f"{method} {path} no_body", http_request(method, path, b"", ct, port=port))
    return Case(f"{method} {path} plain", http_request(method, path, body, ct, port=port))


def _split(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), min(3, len(data) - 1))) if len(data) > 1 else []
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True) if data[a:b]]


def fuzz_case(rng: random.Random, port: int) -> Case:
    """One fuzz request: 80% a JSON route's body mutated, then the request around it."""
    if rng.random() < 0.8:
        path = rng.choice(list(JSON_ROUTES))
        seed_body = dict(JSON_ROUTES[path])
        if path in ("/v1/chat/completions", "/v1/completions") and rng.random() < 0.3:
            seed_body["stream"] = True
        name, body = json_body_mutation(rng, seed_body)
        case = header_mutation(rng, "POST", path, body, port)
        case.kind += f" {name}"
        return case
    method, path = rng.choice(OTHER_ROUTES)
    body = (
        b""
        if method != "PUT"
        else rng.choice([b"", b"HYDR" + rng.randbytes(60), rng.randbytes(200)])
    )
    return header_mutation(rng, method, path, body, port)


def check_reply(case: Case, reply: Reply) -> str | None:
    """What is wrong with a reply, or None. Errors are JSON with an ``error`` object (the
    decode routes' 410 and 202 carry a ``state`` instead); only a malformed request (protocol)
    may get Hypercorn's own bare answer."""
    status, ctype = reply.status, reply.headers.get("content-type", "")
    if case.data.startswith(b"HEAD ") and (status < 500 or status in DOCUMENTED_5XX):
        # Headers only, by HTTP's rules: also a documented 5xx (the connection reserve's 503).
        return None if not reply.body else f"HTTP {status} to HEAD with a body: {reply.body[:120]!r}"
    if (
        status >= 500
        and status not in DOCUMENTED_5XX
        and not (case.protocol and status == 501 and "json" not in ctype)
    ):
        # (Hypercorn's own bare 501 for a Transfer-Encoding it does not implement is HTTP's rule.)
        return f"HTTP {status}: {reply.body[:200]!r}"
    if "json" in ctype:
        try:
            obj = json.loads(reply.body)
        except ValueError:
            return f"HTTP {status} with a body that is not JSON: {reply.body[:120]!r}"
        if status >= 400 and status != 410:
            err = obj.get("error") if isinstance(obj, dict) else None
            if not (isinstance(err, dict) and isinstance(err.get("message"), str)):
                return f"HTTP {status} error without an error object: {reply.body[:200]!r}"
        return None
    if status >= 400 and not case.protocol:
        return f"HTTP {status} not JSON ({ctype!r}): {reply.body[:120]!r}"
    return None


# ---- the campaign ----------------------------------------------------------------------------


@dataclass
class Config:
    duration_s: float = 60.0
    hang_s: float = 30.0
    seed: int = 0
    http_fuzzers: int = 2
    drippers: int = 4
    drip_interval_s: float = 0.05
    stalled_readers: int = 2
    stall_s: float = 10.0
    idle_connections: int = 200
    streams: int = 2
    stream_tokens: int = 1500
    shape_pause_s: float = 0.5
    solo_s: float = 45.0  # then each shape alone beside the streams, this long at most (0: none)
    min_fuzz_requests: int = 0  # per HTTP fuzzer, even past the deadline
    rpc_frames: int = 0  # RPC frames to send, even past the deadline (0: until the deadline)


SHORT = Config(
    duration_s=5.0,
    hang_s=20.0,
    http_fuzzers=2,
    drippers=2,
    drip_interval_s=0.002,
    stalled_readers=1,
    stall_s=2.0,
    idle_connections=100,
    streams=2,
    stream_tokens=150,
    shape_pause_s=0.1,
    solo_s=0.0,
    min_fuzz_requests=40,
    rpc_frames=150,
)


class Campaign:
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

    async def rpc_fuzzer(self, seeds: fuzz.Seeds) -> None:
        remaining = max(1.0, self.deadline - time.monotonic())
        try:
            report = await self._rpc_campaign(seeds, remaining)
        except (OSError, httpx.HTTPError) as exc:  # the engine went away under it
            self.ledger.find("rpc_fuzzer_lost_engine", f"{type(exc).__name__}: {exc}")
            return
        self._rpc_report(report)

    async def _rpc_campaign(self, seeds: fuzz.Seeds, remaining: float) -> fuzz.FuzzReport:
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

    def _solo_fuzz_cases(self) -> list[tuple[str, Case]]:
        ct = [("Content-Type", "application/json")]

        def post(path: str, body: bytes) -> Case:
            return Case(path, http_request("POST", path, body, ct, port=self.port))

        return [
            (
                "fuzz_nest200k_chat",
                post(
                    "/v1/chat/completions", b'{"messages":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
                ),
            ),
            (
                "fuzz_bigint50k_completions",
                post("/v1/completions", b'{"prompt":"hi","max_tokens":' + b"9" * 50_000 + b"}"),
            ),
            (
                "fuzz_6mb_escaped_string_tokenize",
                post("/tokenize", json.dumps({"content": "é" * 1_000_000}).encode()),
            ),
            (
                "detokenize_16k_tokens_ok",
                post("/detokenize", json.dumps({"tokens": [12] * 16_000}).encode()),
            ),
            (
                "tokenize_with_pieces_ok",
                post(
                    "/tokenize",
                    json.dumps({"content": "hello world " * 1000, "with_pieces": True}).encode(),
                ),
            ),
            (
                "completions_2000_token_prompt_ok",
                post(
                    "/v1/completions", json.dumps({"prompt": [12] * 2000, "max_tokens": 4}).encode()
                ),
            ),
            (
                "chat_8k_char_prompt_ok",
                post(
                    "/v1/chat/completions",
                    json.dumps(
                        {
                            "messages": [{"role": "user", "content": "hello world " * 700}],
                            "max_tokens": 4,
                        }
                    ).encode(),
                ),
            ),
        ]

    def _shape_cases(self) -> list[tuple[str, Case]]:
        port = self.port
        text = ("hello world " * (BIG // 12 + 1))[:BIG]
        ct = [("Content-Type", "application/json")]

        def post(path: str, body: bytes) -> Case:
            return Case(path, http_request("POST", path, body, ct, port=port))

        tokens = b"[" + b"12," * (BIG // 3 - 1) + b"12]"
        over = 64 * 2**20 + 1  # --max-json-bytes (default) + 1, declared: refused before reading
        # Under the prompt routes' cap (2048 positions a slot here: ~1.2 MB) but over what
        # the 32768 cells' ids take (~0.8 MB): before issue 28 it was parsed, then refused.
        ids_over_cells = b"[" + b"12," * 370_000 + b"12]"
        return [
            ("detokenize_12mb", post("/detokenize", b'{"tokens":' + tokens + b"}")),
            ("detokenize_over_cells", post("/detokenize", b'{"tokens":' + ids_over_cells + b"}")),
            # A body on a route that takes none: refused before Quart buffers it (issue 28).
            (
                "get_with_body",
                Case(
                    "get_with_body",
                    http_request("GET", "/v1/models", b"x" * 1_000_000, [("Content-Type", "text/plain")], port=port),
                    protocol=True,
                ),
            ),
            (
                "chat_12mb_prompt",
                post(
                    "/v1/chat/completions",
                    json.dumps(
                        {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
                    ).encode(),
                ),
            ),
            ("kv_pull_nonloopback", Case("", b"")),
            (
                "completions_12mb_prompt",
                post("/v1/completions", json.dumps({"prompt": text, "max_tokens": 4}).encode()),
            ),
            (
                "completions_4m_token_array",
                post("/v1/completions", b'{"max_tokens":4,"prompt":' + tokens + b"}"),
            ),
            ("kv_pull_any_address", Case("", b"")),
            (
                "tokenize_12mb",
                post("/tokenize", json.dumps({"content": text, "with_pieces": True}).encode()),
            ),
            ("tokenize_vllm_12mb", post("/tokenize", json.dumps({"prompt": text}).encode())),
            ("kv_pull_unroutable", Case("", b"")),
            (
                "render_12mb",
                post(
                    "/v1/chat/completions/render",
                    json.dumps({"messages": [{"role": "user", "content": text}]}).encode(),
                ),
            ),
            (
                "apply_template_12mb",
                post(
                    "/apply-template",
                    json.dumps({"messages": [{"role": "user", "content": text}]}).encode(),
                ),
            ),
            ("kv_pull_metadata", Case("", b"")),
            # Headers only: the 413 must come before any of the body is sent.
            (
                "body_over_limit",
                Case(
                    "body_over_limit",
                    http_request(
                        "POST", "/tokenize", b"", [*ct, ("Content-Length", str(over))], port=port
                    ),
                ),
            ),
            ("chunked_over_limit", Case("", b"")),
            ("kv_pull_hostname", Case("", b"")),
            ("kv_params_fuzz", Case("", b"")),
            # Schemas that sized or hung the grammar (issue 40): refused before any GBNF is
            # built (a 60-byte minLength of 1e8 took 1.7 GB and froze the loop for seconds).
            *(
                (f"schema_{name}", post("/v1/chat/completions", json.dumps(
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "json_schema": schema}
                ).encode()))
                for name, schema in HOSTILE_SCHEMAS.items()
            ),
        ]

    async def _chunked_sender(self, stream: trio.SocketStream) -> None:
        """A chunked body past --max-json-bytes: refused once past it, not buffered whole."""
        head = http_request(
            "POST",
            "/tokenize",
            b"",
            [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")],
            port=self.port,
        )
        await stream.send_all(head)
        piece = b'{"content":"' + b"x" * (1 << 20)
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        with trio.move_on_after(self.cfg.hang_s):
            for _ in range(80):  # 80 MiB, past the 64 MiB default
                await stream.send_all(chunk)
            await stream.send_all(b"0\r\n\r\n")

    async def kv_pull(self, kind: str, label: str) -> None:
        """A completion whose kv_transfer_params name an export at an address outside
        --kv-pull-allow (loopback by default). No connection may be opened (our listeners
        count any) and the reply is a local prefill with reason not_allowed."""
        params = json.loads(json.dumps(self.ledger.notes.get("_export_params") or {}))
        if not params:
            self.ledger.counts[f"{label} skipped(no export)"] += 1
            return
        host = {
            "kv_pull_nonloopback": self.ledger.notes["_lan_host"],
            "kv_pull_any_address": "0.0.0.0",
            "kv_pull_unroutable": "10.255.255.1",
            "kv_pull_metadata": "169.254.169.254",
            "kv_pull_hostname": "kv.example.invalid",
        }[kind]
        params["remote_host"] = host
        params["remote_port"] = self.ledger.notes["_trap_port"]
        body = json.dumps(
            {
                "prompt": "hello world",
                "max_tokens": 2,
                "temperature": 0,
                "kv_transfer_params": params,
            }
        ).encode()
        case = Case(
            label,
            http_request(
                "POST",
                "/v1/completions",
                body,
                [("Content-Type", "application/json")],
                port=self.port,
            ),
        )
        reply = await self.exchange(label, case)
        if reply is not None and reply.status == 200:
            transfer = json.loads(reply.body).get("kv_transfer", {})
            reason = transfer.get("reason", transfer.get("status"))
            self.ledger.counts[f"{label} reason={reason}"] += 1
            # A name that does not resolve cannot be checked, nor reached: "pull_failed" is
            # right for it (the lookup itself is the one query it causes; no connection).
            if reason != "not_allowed" and not (
                kind == "kv_pull_hostname" and reason == "pull_failed"
            ):
                self.ledger.find("kv_pull_not_refused", f"{kind} ({host}): kv_transfer {transfer}")

    async def kv_params_fuzz(self, label: str) -> None:
        """The next KV_PARAM_BATCH (field, value) pairs of KV_PARAM_FIELDS x KV_PARAM_VALUES
        on a real export's kv_transfer_params, together: each a 200 with a known reason."""
        base = self.ledger.notes.get("_export_params")
        if not base:
            self.ledger.counts[f"{label} skipped(no export)"] += 1
            return
        pairs = [(f, v) for f in KV_PARAM_FIELDS for v in KV_PARAM_VALUES]
        start = self.ledger.notes.get("_kv_params_next", 0)
        self.ledger.notes["_kv_params_next"] = start + KV_PARAM_BATCH

        async def one(field_name: str, value: Any) -> None:
            params = json.loads(json.dumps(base))
            *where, key = field_name.split(".")
            target = params
            for k in where:
                if not isinstance(target.get(k), dict):
                    target[k] = {}
                target = target[k]
            target[key] = value
            body = json.dumps(
                {"prompt": "hello world", "max_tokens": 2, "temperature": 0, "kv_transfer_params": params}
            ).encode()
            headers = [("Content-Type", "application/json")]
            case = Case(label, http_request("POST", "/v1/completions", body, headers, port=self.port))
            reply = await self.exchange(label, case)
            if reply is None or reply.status >= 500:
                return  # (exchange records a 5xx as a finding)
            transfer = json.loads(reply.body).get("kv_transfer", {}) if reply.status == 200 else {}
            reason = transfer.get("reason", transfer.get("status"))
            self.ledger.counts[f"{label} reason={reason}"] += 1
            # (A 4xx is the body's own fault, a lone surrogate say: a client error, checked above.)
            if transfer.get("status") == "fallback" and reason not in KV_PARAM_REASONS:
                self.ledger.find(
                    "kv_params_unexpected", f"{field_name}={value!r:.60}: HTTP {reply.status} {reply.body[:160]!r}"
                )

        async with trio.open_nursery() as nursery:
            for i in range(start, start + KV_PARAM_BATCH):
                nursery.start_soon(one, *pairs[i % len(pairs)])

    async def traps(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """A listener on every interface: the KV pulls aim at its port, so a connection the
        engine should not have opened is seen."""
        lan = _lan_address()
        port = fuzz_free_port("0.0.0.0")
        self.ledger.notes["_lan_host"] = lan
        self.ledger.notes["_trap_port"] = port
        # Every interface: a connection to the LAN address, to 0.0.0.0 (which Linux sends to
        # this host) or to any local address lands here; no pull is ever aimed at loopback.
        listeners = await trio.open_tcp_listeners(port, host="0.0.0.0")
        task_status.started()

        async def caught(stream: trio.SocketStream) -> None:
            self.ledger.find(
                "kv_pull_connected",
                f"the engine connected to a disallowed address {stream.socket.getsockname()}",
            )
            await stream.aclose()

        with trio.move_on_after(self.end + self.cfg.hang_s - time.monotonic()):
            await trio.serve_listeners(caught, listeners)

    async def health_probe(self) -> None:
        async with httpx.AsyncClient(base_url=self.engine.url, timeout=self.cfg.hang_s) as h:
            while self.running():
                t0 = time.monotonic()
                try:
                    r = await h.get("/health")
                    self.ledger.health_ms.append((time.monotonic() - t0) * 1000)
                    if r.status_code != 200:
                        self.ledger.find("health_not_ok", f"/health {r.status_code} {r.text[:100]}")
                except httpx.TimeoutException:
                    self.ledger.find("hang", f"/health gave no answer within {self.cfg.hang_s:g} s")
                except httpx.HTTPError as exc:
                    self.ledger.find("health_error", f"/health {type(exc).__name__}: {exc}")
                await trio.sleep(0.25)

    async def watch_process(self, rss: list[tuple[float, int]]) -> None:
        """RSS every 0.1 s; the crash check (the engine's process has exited)."""
        while time.monotonic() < self.end + self.cfg.hang_s:
            if self.engine.proc is not None and self.engine.proc.poll() is not None:
                self.ledger.find("crash", f"engine exited with {self.engine.proc.returncode}")
                self.crashed.set()
                return
            try:
                rss.append((time.monotonic(), self.engine.rss_bytes()))
            except (OSError, KeyError):
                pass
            await trio.sleep(0.1)

    async def capture_export(self) -> None:
        """A real export (do_remote_decode) from this engine: the KV pull shapes reuse its
        kv_transfer_params with another address."""
        async with httpx.AsyncClient(base_url=self.engine.url, timeout=self.cfg.hang_s) as h:
            r = await h.post(
                "/v1/completions",
                json={
                    "prompt": "hello world",
                    "max_tokens": 2,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
            )
            if r.status_code == 200:  # (no export: the KV-pull shapes are counted as skipped)
                self.ledger.notes["_export_params"] = r.json().get("kv_transfer_params")


def fuzz_free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _lan_address() -> str:
    """This host's address on a non-loopback interface (where a listener can be), else a
    documentation address with no listener."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.123", 9))  # UDP: no packet is sent, the route picks the address
            addr = s.getsockname()[0]
            if not addr.startswith("127."):
                return addr
    except OSError:
        pass
    return "192.0.2.1"


# ---- the stream reader (its own process) ------------------------------------------------------


def read_streams(
    port: int, n: int, duration_s: float, n_tokens: int, hang_s: float, out: Path
) -> None:
    """``n`` streaming completions at a time, each replaced when it ends, until
    ``duration_s``; every token-bearing event stamped (CLOCK_MONOTONIC) as it arrives."""
    sel = selectors.DefaultSelector()
    until = time.monotonic() + duration_s
    stop = out.with_suffix(".stop")  # the driver's "done" (the solo phase's end is not known ahead)
    runs: list[dict[str, Any]] = []
    started = 0
    health_ms: list[float] = []
    health_errors: list[str] = []

    def probe_health() -> None:
        # /health from this light process too: the driver's own probe waits on the driver's CPU.
        import http.client

        while time.monotonic() < until and not stop.exists():
            t0 = time.monotonic()
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=hang_s)
                c.request("GET", "/health")
                status = c.getresponse().status
                c.close()
                health_ms.append((time.monotonic() - t0) * 1000)
                if status != 200:
                    health_errors.append(f"status {status}")
            except OSError as exc:
                health_errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.25)

    import threading

    prober = threading.Thread(target=probe_health, daemon=True)
    prober.start()

    def open_stream(i: int) -> None:
        nonlocal started
        try:
            sock = socket.create_connection(("127.0.0.1", port))
        except OSError as exc:  # the engine is gone or refusing: recorded, not retried
            runs.append(
                {
                    "stream": i,
                    "t0": time.monotonic(),
                    "t1": time.monotonic(),
                    "arrivals": [],
                    "tokens": 0,
                    "done": False,
                    "error": f"connect: {exc}",
                }
            )
            return
        st = Stream(sock, _request(port, words_prompt(24, seed=1000 * i + started), n_tokens))
        sock.sendall(st.request)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, (i, st, time.monotonic()))
        started += 1

    def finish(key: selectors.SelectorKey, error: str = "") -> None:
        i, st, t0 = key.data
        sel.unregister(st.sock)
        st.sock.close()
        runs.append(
            {
                "stream": i,
                "t0": t0,
                "t1": time.monotonic(),
                "arrivals": st.arrivals,
                "tokens": st.tokens,
                "done": st.done,
                "error": error or st.error,
            }
        )
        if time.monotonic() < until and not stop.exists():
            open_stream(i)

    for i in range(n):
        open_stream(i)
    while sel.get_map():
        for key, _ in sel.select(timeout=0.2):
            st = key.data[1]
            now = time.monotonic()
            try:
                chunk = st.sock.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError as exc:
                finish(key, f"{type(exc).__name__}: {exc}")
                continue
            if chunk:
                st.buf += chunk
                _consume(st, now)
                if not st.done:
                    continue
            finish(key)
        now = time.monotonic()
        if stop.exists():  # the campaign is over: what still streams is cut, not a failure
            for key in list(sel.get_map().values()):
                finish(key, STOPPED)
            break
        for key in list(sel.get_map().values()):
            _, st, t0 = key.data
            last = st.arrivals[-1] if st.arrivals else t0
            if now - last > hang_s:
                finish(key, f"HANG: no token for {hang_s:g} s")
    prober.join(timeout=hang_s + 1)
    out.write_text(
        json.dumps({"runs": runs, "health_ms": health_ms, "health_errors": health_errors})
    )


# ---- analysis ---------------------------------------------------------------------------------


def analyse(runs: list[dict[str, Any]], spans: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Inter-token gaps of the well-formed streams; each gap over NOTABLE_GAP_MS is matched
    with the hostile requests in flight during it."""
    gaps: list[tuple[float, float, float]] = []  # ms, start, end
    for run in runs:
        a = run["arrivals"]
        gaps += [((b - x) * 1000, x, b) for x, b in pairwise(a)]
        if run["error"].startswith("HANG") and a:
            gaps.append(((run["t1"] - a[-1]) * 1000, a[-1], run["t1"]))
    ms = [g[0] for g in gaps]
    out: dict[str, Any] = {
        "stream_runs": len(runs),
        "tokens_timed": sum(len(r["arrivals"]) for r in runs),
        "stream_errors": [r["error"] for r in runs if r["error"] and r["error"] != STOPPED][:10],
        "streams_without_done": sum(1 for r in runs if not r["done"] and r["error"] != STOPPED),
        "gap_ms": {
            "p50": round(percentile(ms, 50), 2),
            "p99": round(percentile(ms, 99), 2),
            "max": round(max(ms), 2),
        }
        if ms
        else {},
    }
    spans_by_start = sorted(spans, key=lambda s: s[1])

    def in_flight(t0: float, t1: float) -> list[str]:
        return sorted({k for k, s0, s1 in spans_by_start if s0 < t1 and s1 > t0})

    worst = sorted(gaps, reverse=True)[:10]
    out["worst_gaps"] = [
        {
            "gap_ms": round(g, 1),
            "at_s": round(a - (runs[0]["t0"] if runs else 0), 2),
            "started_just_before": sorted({k for k, s0, _ in spans_by_start if a - 0.5 < s0 < b}),
            "in_flight": in_flight(a, b),
        }
        for g, a, b in worst
    ]
    # Per kind: the worst gap (and p99) among gaps it was in flight for, and how many
    # notable gaps it overlapped: the kind whose presence moves the tail is the offender.
    per_kind: dict[str, list[float]] = defaultdict(list)
    for g, a, b in gaps:
        for k in in_flight(a, b) if g > NOTABLE_GAP_MS or len(gaps) < 20000 else ():
            per_kind[k].append(g)
    out["by_kind_in_flight"] = {
        k: {
            "gaps": len(v),
            "p99_ms": round(percentile(v, 99), 1),
            "max_ms": round(max(v), 1),
            "notable": sum(1 for x in v if x > NOTABLE_GAP_MS),
        }
        for k, v in sorted(per_kind.items(), key=lambda kv: -max(kv[1]))
    }
    # The solo phase: one request at a time, so a gap over its span is its own doing.
    out["solo"] = {}
    for kind, s0, s1 in spans:
        if kind.startswith("solo "):
            during = [g for g, a, b in gaps if a < s1 and b > s0]
            out["solo"][kind[5:]] = {
                "ms": round((s1 - s0) * 1000, 1),
                "gaps": len(during),
                "max_gap_ms": round(max(during), 1) if during else None,
            }
    return out


# ---- running it ---------------------------------------------------------------------------------


def budget_bytes(model: Path, ctx: int, args: dict[str, int]) -> dict[str, int]:
    from hydra_trio.model.synthetic import PRESETS

    p = PRESETS["tiny"]
    kv = 2 * p.n_layer * (p.n_embd * p.n_head_kv // p.n_head) * 2 * ctx  # K and V, f16, every cell
    parts = {
        "model": model.stat().st_size,
        "kv_cache": kv,
        "max_inflight_bytes": args["max_inflight_bytes"],
        "cache_ram": args["cache_ram_mib"] << 20,
        "kv_export_max_bytes": args["kv_export_max_bytes"],
        "runtime_allowance": RUNTIME_ALLOWANCE_MIB << 20,
    }
    parts["total"] = sum(parts.values())
    return parts


async def run(
    engine: EngineProcess, cfg: Config, seeds: fuzz.Seeds
) -> tuple[Ledger, list[tuple[float, int]]]:
    ledger = Ledger()
    campaign = Campaign(engine, cfg, ledger)
    await campaign.capture_export()
    rss: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(campaign.watch_process, rss)
        await nursery.start(campaign.traps)
        ended: dict[str, float] = ledger.notes.setdefault("actor_ended_at_s", {})

        async def timed(name: str, fn: Any, *args: Any) -> None:
            # When each actor stopped: one that overruns the deadline says which waits are long.
            await fn(*args)
            ended[name] = round(time.monotonic() - campaign.t0, 1)

        async with trio.open_nursery() as load:
            load.start_soon(timed, "health_probe", campaign.health_probe)
            load.start_soon(timed, "rpc_fuzzer", campaign.rpc_fuzzer, seeds)
            load.start_soon(timed, "idle_connections", campaign.idle_connections)
            load.start_soon(timed, "shapes", campaign.shapes)
            for i in range(cfg.http_fuzzers):
                load.start_soon(timed, f"http_fuzzer{i}", campaign.http_fuzzer, i)
            for i in range(cfg.drippers):
                load.start_soon(timed, f"dripper{i}", campaign.dripper, i)
            for i in range(cfg.stalled_readers):
                load.start_soon(timed, f"stalled_reader{i}", campaign.stalled_reader, i)
        if cfg.solo_s > 0:
            await campaign.solo()
        nursery.cancel_scope.cancel()  # the traps and the watcher
    ledger.notes["load_s"] = round(time.monotonic() - campaign.t0, 1)
    return ledger, rss


async def after(engine: EngineProcess, settle_s: float) -> dict[str, Any]:
    """Once everything hostile has stopped: slots back to idle, no decode running, /health
    and a well-formed request and DECODE work (fuzz.engine_health)."""
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as h:
        t0 = time.monotonic()
        with trio.move_on_after(settle_s):
            while any(s["is_processing"] for s in (await h.get("/slots")).json()):  # noqa: ASYNC110 (an HTTP poll)
                await trio.sleep(0.1)
        out["slots_idle_after_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        out["health_status"] = (await h.get("/health")).status_code
        out["health_ms"] = round((time.monotonic() - t0) * 1000, 1)
        r = await h.post(
            "/v1/completions", json={"prompt": "hello world", "max_tokens": 8, "temperature": 0}
        )
        out["completion_ok"] = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        out["server_itl"] = _server_itl((await h.get("/metrics")).text)
        out.update(await fuzz.engine_health(engine.rpc_port, h, settle_s=settle_s))
    out["ok"] = bool(out["ok"] and out["completion_ok"] and out["health_status"] == 200)
    return out


def _server_itl(metrics_text: str) -> dict[str, int]:
    """The engine's own inter-token gaps (vllm:inter_token_latency_seconds, every request
    that generated): how many exceeded 0.2 s and 0.3 s, its bucket bounds around the goal.
    Beside the client's gaps, this tells the engine's delays from the client's own (a
    stream reader not scheduled on a busy machine)."""
    from prometheus_client.parser import text_string_to_metric_families

    le: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:inter_token_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    le[bound] = le.get(bound, 0.0) + sample.value
    total = le.get(float("inf"), 0.0)
    return {
        "gaps": int(total),
        "over_0.2_s": int(total - le.get(0.2, total)),
        "over_0.3_s": int(total - le.get(0.3, total)),
    }


def campaign(cfg: Config, *, log_dir: Path, engine_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start an engine, run the campaign, stop it; the report (a dict)."""
    from hydra_trio.model.synthetic import write_model

    model = write_model(log_dir / "tiny.gguf", "tiny", seed=0)
    flags = {"max_inflight_bytes": 64 << 20, "cache_ram_mib": 16, "kv_export_max_bytes": 16 << 20}
    # 2048 cells a slot; enough slots that the well-formed streams never wait for one behind
    # the stalled readers, drips, fuzzed generations and RPC DECODEs (--slot-wait-s 5).
    slots, ctx = 16, 32768
    engine = EngineProcess(
        str(model),
        slots=slots,
        ctx_size=ctx,
        threads=1,
        batch_size=64,
        extra=(
            "--max-inflight-bytes",
            str(flags["max_inflight_bytes"]),
            "--cache-ram-mib",
            str(flags["cache_ram_mib"]),
            "--kv-export-max-bytes",
            str(flags["kv_export_max_bytes"]),
            "--slot-wait-s",
            "5",
            "--shutdown-grace-s",
            "3",  # the exports the KV-pull shapes leave unpulled would hold the stop 10 s
            "--kv-pull-timeout-s",
            "1",  # a failed pull answers at its deadline: the fuzzed params' pulls, quickly
            *engine_args,
        ),
    )
    engine.start(log_dir, "engine")
    stream_out = log_dir / "streams.json"
    try:
        rss_start = engine.rss_bytes()
        seeds = trio.run(
            fuzz.capture_seeds, engine.rpc_port
        )  # needs slots 0 and 1 free: before any load
        # The well-formed streams, read in their own process (see read_streams).
        reader = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.hostile",
                "--stream-reader",
                str(engine.http_port),
                str(cfg.streams),
                str(cfg.duration_s + cfg.solo_s + 2 * cfg.hang_s),
                str(cfg.stream_tokens),
                str(cfg.hang_s),
                str(stream_out),
            ],
            cwd=Path(__file__).resolve().parents[1],
        )
        ledger, rss = trio.run(run, engine, cfg, seeds)
        stream_out.with_suffix(".stop").touch()  # the streams end with the load
        try:
            reader.wait(timeout=cfg.hang_s + 30)
        except subprocess.TimeoutExpired:
            reader.kill()
            ledger.find("hang", "the stream reader did not finish")
        alive = engine.proc is not None and engine.proc.poll() is None
        health = trio.run(after, engine, min(30.0, cfg.hang_s)) if alive else {"ok": False}
        peak = engine.peak_rss_bytes() if alive else max((b for _, b in rss), default=0)
    finally:
        engine.stop()
    code = engine.proc.returncode if engine.proc is not None else None
    log_text = engine.log_path.read_text(errors="replace") if engine.log_path else ""
    timed = json.loads(stream_out.read_text()) if stream_out.exists() else {}
    runs = timed.get("runs", [])
    for err in timed.get("health_errors", [])[:20]:
        ledger.find("health_error", f"/health from the stream reader: {err}")
    streams = analyse(runs, ledger.spans)
    for r in runs:
        if r["error"].startswith("HANG"):
            ledger.find("hang", f"well-formed stream {r['stream']}: {r['error']}")
        elif r["error"] != STOPPED and (r["error"] or not r["done"]):
            ledger.find(
                "stream_error", f"well-formed stream {r['stream']}: {r['error'] or 'no [DONE]'}"
            )
    if not health.get("ok"):
        ledger.find("unhealthy_after", json.dumps(health))
    if "Traceback" in log_text:
        ledger.notes["first_traceback"] = _first_traceback(log_text)
    # The engine's own unhandled errors (a bug of ours), apart from Hypercorn's (see docs/reliability.md).
    for line in log_text.splitlines():
        if "unhandled error in" in line or "background task" in line:
            ledger.find("unhandled_error_in_log", line)
        elif "Error in ASGI Framework" in line:
            ledger.find("hypercorn_error_in_log", line)
    budget = budget_bytes(model, ctx, flags)
    kinds: Counter[str] = Counter()
    for key, n in ledger.counts.items():
        if not key.startswith(("FINDING", "mutation ")):
            kinds[key] += n
    findings = {k: len(v) for k, v in ledger.findings.items()}
    crashes = max(findings.get("crash", 0), 0 if alive else 1)
    hm = ledger.health_ms
    gap_max = streams["gap_ms"].get("max", float("nan"))
    report: dict[str, Any] = {
        "config": {**cfg.__dict__, "slots": slots, "ctx_size": ctx, **flags},
        "requests": sum(n for k, n in kinds.items() if not k.startswith("rpc frames")),
        "rpc_frames": kinds.get("rpc frames", 0),
        "by_kind_and_status": dict(sorted(kinds.items())),
        "by_mutation_and_status": dict(
            sorted((k[9:], n) for k, n in ledger.counts.items() if k.startswith("mutation "))
        ),
        "findings": findings,
        "finding_examples": {k: v[:5] for k, v in ledger.findings.items()},
        "crashes": crashes,
        "hangs": findings.get("hang", 0),
        "server_errors_5xx": findings.get("server_error", 0),
        "engine_exit_code": code,
        "engine_alive_at_end": alive,
        "tracebacks_in_log": log_text.count("Traceback"),
        "rss_mb": {
            "start": round(rss_start / 2**20, 1),
            "peak": round(peak / 2**20, 1),
            **_rss_peak(rss, ledger.spans),
            "budget": round(budget["total"] / 2**20, 1),
            "budget_parts_mb": {k: round(v / 2**20, 2) for k, v in budget.items()},
        },
        "request_ms_by_kind": _span_ms(ledger.spans),
        "health_ms": _ms(hm),  # from the driver (busy itself)
        "health_ms_light_client": _ms(
            timed.get("health_ms", [])
        ),  # from the stream reader's process
        "after": health,
        "streams": streams,
        "notes": {k: v for k, v in ledger.notes.items() if not k.startswith("_")},
    }
    report["goals"] = {
        "0 crashes": crashes == 0 and alive,
        "0 hangs": report["hangs"] == 0,
        "RSS within budget": peak <= budget["total"],
        f"worst stream gap <= {GOAL_GAP_MS:g} ms": bool(gap_max <= GOAL_GAP_MS),
    }
    report["clean"] = not findings and alive and code == 0
    return report


def _rss_peak(
    rss: list[tuple[float, int]], spans: list[tuple[str, float, float]]
) -> dict[str, Any]:
    """The largest sampled RSS, and what was in flight then (what the memory was for)."""
    if not rss:
        return {}
    t, b = max(rss, key=lambda x: x[1])
    return {
        "sampled_peak": round(b / 2**20, 1),
        "in_flight_at_peak": sorted({k for k, s0, s1 in spans if s0 <= t <= s1}),
    }


def _ms(v: list[float]) -> dict[str, float]:
    return (
        {
            "n": len(v),
            "p50": round(percentile(v, 50), 1),
            "p99": round(percentile(v, 99), 1),
            "max": round(max(v), 1),
        }
        if v
        else {}
    )


def _span_ms(spans: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    by: dict[str, list[float]] = defaultdict(list)
    for kind, t0, t1 in spans:
        by[kind].append((t1 - t0) * 1000)
    return {
        k: {"n": len(v), "p50": round(percentile(v, 50), 1), "max": round(max(v), 1)}
        for k, v in sorted(by.items())
    }


def _first_traceback(log: str) -> str:
    i = log.find("Traceback")
    start = log.rfind("\n", 0, log.rfind("\n", 0, i)) + 1  # the line before: what was logged
    return log[start : i + 8000]


def render(report: dict[str, Any]) -> str:
    r = report
    s = r["streams"]
    lines = [
        f"hostile campaign: {r['config']['duration_s']:g} s, {r['requests']:,} HTTP/shape requests, {r['rpc_frames']:,} RPC frames",
        f"  findings: {r['findings'] or 'none'}",
        f"  engine: alive={r['engine_alive_at_end']} exit={r['engine_exit_code']} tracebacks={r['tracebacks_in_log']} healthy after={r['after'].get('ok')}",
        f"  RSS MB: start {r['rss_mb']['start']}, peak {r['rss_mb']['peak']}, budget {r['rss_mb']['budget']}; "
        f"in flight at the sampled peak: {[k for k in r['rss_mb'].get('in_flight_at_peak', []) if not k.startswith('fuzz ')]}",
        f"  /health ms: from the driver {r['health_ms']}; from a light client {r['health_ms_light_client']}",
        f"  streams: {s['stream_runs']} runs, {s['tokens_timed']:,} tokens; gap ms {s['gap_ms']}",
        f"  the engine's own inter-token gaps (all generating requests): {report['after'].get('server_itl')}",
    ]
    for g in s["worst_gaps"][:3]:
        shapes = [k for k in g["in_flight"] if not k.startswith("fuzz ")]
        n_fuzz = len(g["in_flight"]) - len(shapes)
        lines.append(
            f"    gap {g['gap_ms']} ms at {g['at_s']} s; in flight: {shapes} and {n_fuzz} fuzz kinds"
        )
    top = Counter({k: n for k, n in r["by_kind_and_status"].items()}).most_common(14)
    lines.append("  top kinds: " + ", ".join(f"{k}={n}" for k, n in top))
    for k, v in list(r["finding_examples"].items())[:6]:
        lines.append(f"  {k}: {v[0][:200]}")
    if s.get("solo"):
        lines.append(
            "  alone beside the streams (request ms / worst gap ms): "
            + ", ".join(
                f"{k} {v['ms']:.0f}/{v['max_gap_ms']}"
                for k, v in sorted(s["solo"].items(), key=lambda kv: -(kv[1]["max_gap_ms"] or 0))
            )
        )
    for goal, ok in r["goals"].items():
        lines.append(f"  GOAL {goal}: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stream-reader"]:  # the stream reader's own process
        port, n, dur, tokens, hang, out = argv[1:7]
        read_streams(int(port), int(n), float(dur), int(tokens), float(hang), Path(out))
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.hostile", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="how long the load runs (default 60; --short: 5)",
    )
    ap.add_argument("--short", action="store_true", help="the CI form: a few seconds, fewer actors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=None, help="a reply later than this is a hang")
    ap.add_argument("--json", type=Path, default=None, help="where to write the report")
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the engine's log (and the streams' timings) here",
    )
    ap.add_argument(
        "--engine-args",
        default="",
        help="more `hydra-trio serve` flags, e.g. '--kv-pull-allow 0.0.0.0/0' to see the KV-pull trap fire",
    )
    args = ap.parse_args(argv)
    cfg = SHORT if args.short else Config()
    cfg = Config(**{**cfg.__dict__, "seed": args.seed})
    if args.duration_s is not None:
        cfg.duration_s = args.duration_s
    if args.hang_s is not None:
        cfg.hang_s = args.hang_s
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        report = campaign(
            cfg, log_dir=args.log_dir, engine_args=tuple(shlex.split(args.engine_args))
        )
    else:
        with tempfile.TemporaryDirectory(prefix="hydra-hostile-") as tmp:
            report = campaign(
                cfg, log_dir=Path(tmp), engine_args=tuple(shlex.split(args.engine_args))
            )
    out = args.json or RESULTS / ("hostile-short.json" if args.short else "hostile.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"report: {out}")
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
