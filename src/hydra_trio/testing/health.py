"""An engine's health after a campaign, read over its HTTP and RPC faces: every decode
ended, every slot idle, /health ok, and a valid PREFILL + DECODE still works."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import trio

from ..rpc.client import RpcClient, build_decode_frame

MESSAGES = [{"role": "user", "content": "hello world"}]
RUNNING = ("validating", "restoring", "generating")


async def decode_ends(http: httpx.AsyncClient) -> Counter[str]:
    r = await http.get("/v1/decode")
    return Counter(e["state"] for e in r.json())


async def engine_health(rpc_port: int, http: httpx.AsyncClient, *, settle_s: float = 30.0) -> dict[str, Any]:
    """After the campaign: no decode still running (each is DELETEd if it has not ended
    within ``settle_s``), every slot idle, /health ok, and a valid PREFILL + DECODE works."""
    out: dict[str, Any] = {}
    with trio.move_on_after(settle_s):
        while any(e["state"] in RUNNING for e in (await http.get("/v1/decode")).json()):  # noqa: ASYNC110 (an HTTP poll)
            await trio.sleep(0.05)
    for e in (await http.get("/v1/decode")).json():
        if e["state"] in RUNNING:
            await http.delete(f"/v1/decode/{e['decode_request_id']}")
    out["running_after"] = sum(1 for e in (await http.get("/v1/decode")).json() if e["state"] in RUNNING)
    async with await RpcClient.connect("127.0.0.1", rpc_port) as c:
        info = await c.info()
        metas = [(await c.state_meta(i)).meta for i in range(info.meta["n_slots"])]
        out["stuck_slots"] = sum(1 for m in metas if m["is_processing"] or m["is_transferring"])
        resp = await c.decode(0, build_decode_frame({"messages": MESSAGES, "n_predict": 4, "temperature": 0}, b""))
        rid = resp.meta["decode_request_id"]
    r = await http.get(f"/v1/decode/{rid}", params={"wait": 30})
    out["final_decode"] = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    out["health_status"] = (await http.get("/health")).status_code
    out["ok"] = (
        out["running_after"] == 0 and out["stuck_slots"] == 0 and out["final_decode"] and out["health_status"] == 200
    )
    return out
