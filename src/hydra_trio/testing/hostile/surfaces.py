"""The campaign's newer surfaces (issue 50): the dialect routes' shapes (tiny messages up to
the body cap and up to a slot's turns, the issue's 5xx bodies, template kwargs that would set
what the engine renders, schema bounds of 400 digits), and the probes that need an engine of
their own or many decodes: auth roles on every route, a model that writes JSON a thousand deep
in a format that reads calls without tools, cache salts kept apart, and decode ids that do
not predict one another (the former allocator's inversion, tried on every id)."""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from ...http.plumbing import routes
from ...rpc.client import RpcClient, build_decode_frame, decode_call
from ..dialectfuzz import BODIES, corpus
from ..process import EngineProcess
from .campaign_config import MESSAGES, Ledger
from .httpfuzz import Case
from .rawhttp import http_request

TINY = {"role": "user", "content": "a"}
SLOT_POSITIONS = 2048  # the campaign engine's (run.py: 16 slots of 2,048 cells)
BODY_CAP = 3 * 32 * SLOT_POSITIONS + (1 << 20)  # its prompt routes' body cap (engine/inputs.py)
# Variables the engine renders itself: a template kwarg that sets one is a 400 naming it.
RESERVED_KWARGS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "namespace",
    "raise_exception",
)
HUGE = int("9" * 400)  # a schema bound no float holds (the schema policy relaxes it, or a 400 with strict)
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength")
DEEP = "[" * 1000 + "]" * 1000
BOUND_SHAPES = "schema_bound_"


def tiny_messages_body(route: str, limit: int, count: int | None = None) -> bytes:
    """As many tiny messages as fit ``limit`` bytes (or ``count``), in the route's shape."""
    item = json.dumps(TINY, separators=(",", ":")).encode()
    n = min((limit - 200) // (len(item) + 1), count or limit)
    items = b"[" + b",".join([item] * n) + b"]"
    key, extra = (
        (b"input", b'"max_output_tokens":1,')
        if route.startswith("/v1/responses")
        else (b"messages", b'"max_tokens":1,')
    )
    if route.endswith(("count_tokens", "input_tokens")):
        extra = b""
    return b"{" + extra + b'"' + key + b'":' + items + b"}"


def surface_cases(port: int, body_cap: int = BODY_CAP) -> list[tuple[str, Case]]:
    """The dialects' shapes, sent like the others (each alone in the solo phase too)."""
    ct = [("Content-Type", "application/json")]

    def post(path: str, body: bytes | dict[str, Any]) -> Case:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return Case(path, http_request("POST", path, data, ct, port=port))

    out: list[tuple[str, Case]] = []
    for route in BODIES:
        name = route.removeprefix("/v1/").replace("/", "_")
        out.append((f"tiny_messages_cap_{name}", post(route, tiny_messages_body(route, body_cap))))
        out.append(
            (
                f"tiny_messages_{SLOT_POSITIONS - 1}_{name}",
                post(route, tiny_messages_body(route, body_cap, SLOT_POSITIONS - 1)),
            )
        )
    for i, (route, body) in enumerate(corpus()):  # the 5xx bodies
        out.append((f"issue50_body_{i}_{route.removeprefix('/v1/').replace('/', '_')}", post(route, body)))
    for name in RESERVED_KWARGS:
        out.append(
            (
                f"template_kwarg_{name}",
                post(
                    "/v1/chat/completions",
                    {
                        "messages": MESSAGES,
                        "max_tokens": 2,
                        "chat_template_kwargs": {name: [{"role": "user", "content": "x"}]},
                    },
                ),
            )
        )
    for bound in BOUNDS:
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer" if "Length" not in bound else "string", bound: HUGE}},
        }
        out.append(
            (
                f"{BOUND_SHAPES}{bound}_chat",
                post(
                    "/v1/chat/completions",
                    {
                        "messages": MESSAGES,
                        "max_tokens": 2,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                    },
                ),
            )
        )
        out.append(
            (
                f"{BOUND_SHAPES}{bound}_responses",
                post(
                    "/v1/responses",
                    {
                        "input": "hi",
                        "max_output_tokens": 2,
                        "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
                    },
                ),
            )
        )
        out.append((f"{BOUND_SHAPES}{bound}_messages", post("/v1/messages", {
            "messages": MESSAGES, "max_tokens": 2, "output_format": {"type": "json_schema", "schema": schema}})))
        out.append(
            (
                f"{BOUND_SHAPES}{bound}_input_schema",
                post(
                    "/v1/messages",
                    {
                        "messages": MESSAGES,
                        "max_tokens": 2,
                        "tools": [{"name": "t", "input_schema": schema}],
                        "tool_choice": {"type": "any"},
                    },
                ),
            )
        )
    return out


# ---- decode ids: the former allocator's inversion (issue 50), tried on every id -----------------

_MASK, _A = (1 << 31) - 1, 0x2C1B3C6D


def _tail(x: int) -> int:
    x ^= x >> 15
    x = (x * 0x297A2D39) & _MASK
    x ^= x >> 12
    x = (x * 0x5BD1E995) & _MASK
    return x ^ (x >> 16)


def _unshift(y: int, k: int) -> int:
    x = y
    for _ in range(31 // k + 1):
        x = y ^ (x >> k)
    return x & _MASK


def predicted_after(one_id: int, n: int = 64) -> set[int]:
    """The ids the former allocator would have made after ``one_id``: from one id it gave
    away every later one (its tail inverted, the counter stepped, mixed again)."""
    x = _unshift(one_id, 16)
    x = (x * pow(0x5BD1E995, -1, 1 << 31)) & _MASK
    x = _unshift(x, 12)
    x = (x * pow(0x297A2D39, -1, 1 << 31)) & _MASK
    x = _unshift(x, 15)
    return {_tail((x + k * _A) & _MASK) for k in range(1, n + 1)}


async def decode_ids(rpc_port: int, http_url: str, n: int, hang_s: float) -> list[int]:
    """``n`` DECODE ids from one-token decodes (each result then deleted)."""
    ids: list[int] = []
    frame = build_decode_frame({"messages": MESSAGES, "n_predict": 1, "temperature": 0}, b"")
    async with (
        await RpcClient.connect("127.0.0.1", rpc_port) as c,
        httpx.AsyncClient(base_url=http_url, timeout=hang_s) as h,
    ):
        tries = 0
        while len(ids) < n and tries < 4 * n:
            tries += 1
            with trio.move_on_after(hang_s):
                r = await c.call(decode_call(len(ids) % 2, frame), check=False)
                if "decode_request_id" in r.meta and r.status == 0:
                    rid = int(r.meta["decode_request_id"])
                    ids.append(rid)
                    await h.get(f"/v1/decode/{rid}", params={"wait": "5"})
                    await h.delete(f"/v1/decode/{rid}")
                else:
                    await trio.sleep(0.05)  # its slot still busy: again
    return ids


async def id_prediction(ledger: Ledger, rpc_port: int, http_url: str, hang_s: float, n: int = 48) -> None:
    ids = await decode_ids(rpc_port, http_url, n, hang_s)
    seen = set(ids)
    hits = sum(len(predicted_after(i) & (seen - {i})) for i in ids)
    steps = {(b - a) & _MASK for a, b in itertools.pairwise(ids)}
    ledger.notes["decode_ids"] = {
        "ids": len(ids),
        "predicted_by_the_former_inversion": hits,
        "distinct_steps": len(steps),
    }
    if hits or (len(ids) > 2 and len(steps) == 1):
        ledger.find("decode_ids_predictable", f"{hits} of {len(ids)} decode ids predicted from another "
                    f"({sorted(ids)[:6]}...)")
    if len(ids) < n // 2:
        ledger.find("decode_ids_missing", f"only {len(ids)} of {n} DECODEs were accepted")


# ---- an engine of their own: auth roles, a deep reply, cache salts --------------------------------

KEY, ADMIN = "plain-key-50", "admin-key-50"
DEEP_GRAMMAR = f'root ::= "<|START_ACTION|>" {json.dumps(DEEP)} "<|END_ACTION|>"\n'


def _path(rule: str) -> str:
    return rule.replace("<raw_id>", "0")


def _error_ok(path: str, r: httpx.Response) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and set(body.get("error", {})) == {"type", "message"}
    return isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str)


def _not_supported(r: httpx.Response) -> bool:
    """A 501 for what this engine was not started to serve (embeddings, rerank: as llama-server
    answers), in the error shape: a documented reply, not a server error."""
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return False
    return r.status_code == 501 and isinstance(err, dict) and err.get("type") == "not_supported_error"


async def auth_roles(ledger: Ledger, h: httpx.AsyncClient) -> None:
    """Every route, with no key, a wrong one, the plain and the admin key: 401 without a key,
    403 for the plain key on an admin route, neither for the admin key; no 5xx."""
    checked = 0
    for route in routes.ROUTES:
        path = _path(route.rule)
        body = b"{}" if route.body != "none" else b""
        for who, headers in (
            ("none", {}),
            ("wrong", {"Authorization": "Bearer nope"}),
            ("plain", {"Authorization": f"Bearer {KEY}"}),
            ("admin", {"x-api-key": ADMIN}),
        ):
            try:
                # A connection each (Connection: close): a refusal answered before its body is
                # read may close a kept-alive connection just as the next request goes out on it
                # (seen under load as "disconnected without a response"), which is HTTP's race,
                # not what this probe is for.
                r = await h.request(route.method, path, content=body,
                                    headers={"content-type": "application/json", "connection": "close", **headers})
            except httpx.HTTPError as exc:
                ledger.find("closed_without_reply", f"auth {who} {route.method} {path}: {type(exc).__name__}: {exc}")
                continue
            checked += 1
            want_refusal = {"none": 401 if route.role else None, "wrong": 401 if route.role else None,
                            "plain": 403 if route.role == routes.Role.ADMIN else None, "admin": None}[who]
            refused = r.status_code in (401, 403)
            if r.status_code >= 500 and r.status_code != 503 and not _not_supported(r):
                ledger.find("server_error", f"auth {who} {route.method} {path}: HTTP {r.status_code} {r.text[:160]}")
            elif want_refusal is not None and r.status_code != want_refusal:
                ledger.find("auth_role", f"{who} key {route.method} {path}: HTTP {r.status_code}, want {want_refusal}")
            elif want_refusal is None and refused:
                ledger.find("auth_role", f"{who} key {route.method} {path}: refused {r.status_code}")
            elif refused and not _error_ok(path, r):
                ledger.find("malformed_reply", f"auth {who} {route.method} {path}: {r.text[:160]}")
    ledger.notes["auth_roles_checked"] = checked


async def deep_reply(ledger: Ledger, h: httpx.AsyncClient) -> None:
    """Cohere's format reads calls (and drops markup) without tools: the model, held to a
    grammar, writes a block of calls whose JSON nests 1,000 deep. Content, whole and
    streamed; before issue 50 a 500, and a stream cut after its first chunk."""
    body = {"messages": MESSAGES, "grammar": DEEP_GRAMMAR, "max_tokens": 2100, "temperature": 0}
    r = await h.post("/v1/chat/completions", json=body)
    want = "<|START_ACTION|>" + DEEP + "<|END_ACTION|>"
    if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] != want:
        ledger.find("deep_reply", f"whole: HTTP {r.status_code} {r.text[:200]}")
    r = await h.post("/v1/chat/completions", json={**body, "stream": True})
    if r.status_code != 200 or not r.text.rstrip().endswith("data: [DONE]"):
        ledger.find("deep_reply", f"streamed: HTTP {r.status_code}, ends {r.text[-120:]!r}")
    ledger.notes["deep_reply_checked"] = True


async def cache_salts(ledger: Ledger, h: httpx.AsyncClient) -> None:
    """A salted prompt's cached prefix is for its salt alone; a malformed salt is a 400."""
    prompt = [{"role": "user", "content": "the salted conversation " * 20}]

    async def cached(salt: str) -> int:
        r = await h.post(
            "/v1/chat/completions", json={"messages": prompt, "max_tokens": 1, "cache_salt": salt, "temperature": 0}
        )
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]) if r.status_code == 200 else -1

    first, again, other = await cached("tenant-a"), await cached("tenant-a"), await cached("tenant-b")
    ledger.notes["cache_salt"] = {"first": first, "same_salt_again": again, "other_salt": other}
    if not (again > 0 and other == 0):
        ledger.find("cache_salt", f"cached tokens: first {first}, same salt {again}, another salt {other}")
    for bad in ("", "x" * 300, 5, ["a"], {"a": 1}):
        r = await h.post("/v1/chat/completions", json={"messages": prompt, "max_tokens": 1, "cache_salt": bad})
        if r.status_code != 400:
            ledger.find("cache_salt", f"cache_salt {bad!r:.40}: HTTP {r.status_code}")


async def own_engine_probes(ledger: Ledger, hang_s: float) -> None:
    """Auth roles, the deep reply and cache salts on an engine of their own (the main one has
    no keys, and its format is not Cohere's)."""
    from hydra_trio.model.synthetic import write_model

    with tempfile.TemporaryDirectory(prefix="hydra-hostile-own-") as tmp:
        model = write_model(Path(tmp) / "tiny.gguf", "tiny", seed=0)
        engine = EngineProcess(str(model), slots=2, ctx_size=8192, threads=1, batch_size=64, extra=(
            "--api-key", KEY, "--admin-api-key", ADMIN, "--tool-call-parser", "cohere", "--slot-wait-s", "5"))
        await trio.to_thread.run_sync(engine.start, Path(tmp), "own")
        t0 = time.monotonic()
        try:
            async with httpx.AsyncClient(base_url=engine.url, timeout=hang_s * 4) as anyone:
                await auth_roles(ledger, anyone)
            async with httpx.AsyncClient(
                base_url=engine.url, timeout=hang_s * 4, headers={"Authorization": f"Bearer {ADMIN}"}
            ) as h:
                await deep_reply(ledger, h)
                await cache_salts(ledger, h)
        except httpx.HTTPError as exc:
            ledger.find("own_engine", f"{type(exc).__name__}: {exc}")
        finally:
            alive = engine.proc is not None and engine.proc.poll() is None
            await trio.to_thread.run_sync(engine.stop)
            log = engine.log_path.read_text(errors="replace") if engine.log_path else ""
        ledger.record("own_engine_probes", "done", t0)
        if not alive:
            ledger.find("crash", "the probes' own engine exited")
        if "Traceback" in log:
            ledger.find("unhandled_error_in_log", "the probes' own engine: " + log[log.index("Traceback"):][:300])


__all__ = ["BODY_CAP", "id_prediction", "own_engine_probes", "surface_cases"]
