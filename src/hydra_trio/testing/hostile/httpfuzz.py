"""The HTTP fuzzer: seeded structure-aware mutations of valid bodies and of the request
around them, and what a correct reply to each is."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from .. import rpcframes as frames
from .campaign_config import DOCUMENTED_5XX, MESSAGES
from .rawhttp import Reply, http_request

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
    # The agents' dialects (issue 50): Anthropic's errors are in its own shape, with an error object too.
    "/v1/messages": {"messages": MESSAGES, "max_tokens": 4, "temperature": 0},
    "/v1/messages/count_tokens": {"messages": MESSAGES, "system": "be brief"},
    "/v1/responses": {"input": "hello world", "max_output_tokens": 4, "temperature": 0},
    "/v1/responses/input_tokens": {"input": "hello world", "instructions": "be brief"},
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
    *frames.INTERESTING,
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
    """rpcframes.replace_somewhere's one-value replacement, then (half the time) a hostile value somewhere."""
    out = frames.replace_somewhere(rng, obj)
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
