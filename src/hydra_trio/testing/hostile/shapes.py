"""The campaign's shapes and traps (issue 22's 12 MB bodies, KV pulls aimed at disallowed
addresses, kv_transfer_params fuzzed field by field), the health probe and the process
watch: the half of Campaign that builds cases."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import trio

from ..net import free_port
from ..process import EngineProcess
from .campaign_config import (
    BIG,
    HOSTILE_GRAMMARS,
    HOSTILE_SCHEMAS,
    KV_PARAM_BATCH,
    KV_PARAM_FIELDS,
    KV_PARAM_REASONS,
    KV_PARAM_VALUES,
    Config,
    Ledger,
)
from .httpfuzz import Case
from .rawhttp import http_request
from .surfaces import surface_cases


class CampaignShapes:
    """Mixed into Campaign: every method reads the campaign's own state (engine, cfg, ledger)."""

    engine: EngineProcess
    cfg: Config
    ledger: Ledger

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
            # Schemas that sized or hung the grammar (issues 40, 49): refused when no value
            # satisfies them, else served with what cannot be enforced relaxed, never a wedge
            # (a 60-byte minLength of 1e8 took 1.7 GB and froze the loop for seconds).
            *(
                (f"schema_{name}", post("/v1/chat/completions", json.dumps(
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "json_schema": schema}
                ).encode()))
                for name, schema in HOSTILE_SCHEMAS.items()
            ),
            *(
                (f"grammar_{name}", post("/v1/chat/completions", json.dumps(
                    # 400 tokens: the engine's own per-token bound serves this grammar to the end
                    # (1800 took 26 s at load 8, past the campaign's hang limit), while the
                    # streams beside it go on; tests/engine/structured/test_guidance.py lowers the bound to see it end.
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "min_tokens": 400,
                     "grammar": grammar}
                ).encode()))
                for name, grammar in HOSTILE_GRAMMARS.items()
            ),
            # The dialect routes (issue 50): tiny messages to the cap and to a slot's turns, the
            # issue's 5xx bodies, template kwargs, schema bounds of 400 digits.
            *surface_cases(port),
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
        lan = lan_address()
        port = free_port("0.0.0.0")
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


def lan_address() -> str:
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
