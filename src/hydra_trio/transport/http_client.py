"""A small async HTTP client for decode results (SSE and JSON), used by the examples,
the benchmarks and the CLI."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """``Authorization`` for an engine started with an API key: ``api_key``, else the
    HYDRA_API_KEY variable (the one `hydra-trio serve` reads); none when neither is set."""
    key = api_key if api_key is not None else os.environ.get("HYDRA_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class DecodeHttpClient:
    def __init__(self, base_url: str, *, timeout: float = 600.0, api_key: str | None = None) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=auth_headers(api_key))

    async def __aenter__(self) -> DecodeHttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def stream(self, request_id: int) -> AsyncIterator[dict[str, Any]]:
        """Yield each SSE event of GET /v1/decode/{id} as a dict, up to [DONE]."""
        async with self.http.stream("GET", f"/v1/decode/{request_id}", headers={"Accept": "text/event-stream"}) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                raise httpx.HTTPStatusError(f"GET /v1/decode/{request_id}: {resp.status_code} "
                                            f"{body[:300]!r}", request=resp.request, response=resp)
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return
                yield json.loads(data)

    async def result(self, request_id: int, *, wait_s: float = 60.0) -> httpx.Response:
        return await self.http.get(f"/v1/decode/{request_id}", params={"wait": wait_s})

    async def delete(self, request_id: int) -> httpx.Response:
        return await self.http.delete(f"/v1/decode/{request_id}")

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.http.post("/v1/chat/completions", json=body)
        resp.raise_for_status()
        return resp.json()
