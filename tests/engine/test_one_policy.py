"""One request policy, one slot life, one busy reply, over every entry point (issue 39):
DECODE refuses what HTTP refuses and carries cache_salt and logprobs; PREFILL labels the
slot with its salt and says when it names another model; CONFIGURE T1 refuses what a
request refuses and names what it does not apply; HEAD of an admin route needs the admin
key; a lease refuses use after its release."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers import MESSAGES, assert_error, decode, decode_ok, frame, get_result, http, rpc
from hydra_trio.rpc.client import configure_call, prefill_call
from hydra_trio.wire import Status

pytestmark = pytest.mark.slow

ENGINE = {"slots": 2, "threads": 1}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"n": 2}, "n"),
        ({"mirostat": 2}, "mirostat"),
        ({"prompt": "x"}, "prompt"),  # a prompt beside messages: chat's rule
        ({"temperature": -1}, "temperature"),
    ],
)
async def test_decode_refuses_what_chat_refuses(
    start_engine: Any, tiny_model: Path, extra: dict[str, Any], param: str
) -> None:
    ep = await start_engine(tiny_model, **ENGINE)
    body = {"messages": MESSAGES, "max_tokens": 4, **extra}
    async with http(ep) as h:
        chat = await h.post("/v1/chat/completions", json=body)
    assert chat.status_code == 400 and chat.json()["error"]["param"] == param, chat.text
    async with await rpc(ep) as c:
        resp = await decode(c, 0, frame(MESSAGES, **extra))
        assert_error(resp, Status.BAD_REQUEST, "BAD_JSON")
        assert resp.meta["error"] == chat.json()["error"]["message"]
        assert (await decode(c, 0, frame(MESSAGES, n_predict=2))).ok  # the engine is fine


async def test_decode_carries_cache_salt_and_logprobs(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, **ENGINE)
    core = ep.state.engine._core
    async with await rpc(ep) as c, http(ep) as h:
        rid = await decode_ok(c, 1, frame(MESSAGES, n_predict=3, cache_salt="tenant-a", logprobs=True, top_logprobs=2))
        body = await get_result(h, rid)
        lp = body["choices"][0]["logprobs"]["content"]
        assert len(lp) == body["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 2 for e in lp)
        assert core.backend.seq_salt[1] == "tenant-a"  # the slot's history is the salt's
        resp = await decode(c, 1, frame(MESSAGES, cache_salt=""))
        assert_error(resp, Status.BAD_REQUEST, "BAD_JSON")


async def test_prefill_labels_the_slot_with_its_salt_and_names_a_model_it_does_not_serve(
    start_engine: Any, tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model, **ENGINE)
    core = ep.state.engine._core
    async with await rpc(ep) as c:
        first = await c.call(prefill_call(0, {"messages": MESSAGES, "cache_salt": "a"}))
        assert core.backend.seq_salt[0] == "a" and first.meta["model_fallback"] is False
        again = await c.call(prefill_call(0, {"messages": MESSAGES, "model": "no-such-alias"}))
        assert core.backend.seq_salt[0] is None  # unsalted now, not still "a"'s
        assert again.meta["model_fallback"] is True
        served = await c.call(prefill_call(0, {"messages": MESSAGES, "model": ep.state.engine.served_name}))
        assert served.meta["model_fallback"] is False


async def test_configure_t1_refuses_a_value_every_request_refuses(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, **ENGINE)
    async with await rpc(ep) as c:
        for body in ({"n_predict": -7}, {"sampling": {"n_predict": -7}}):
            resp = await c.call(configure_call(0, body), check=False)
            assert_error(resp, Status.BAD_REQUEST, "BAD_JSON")
            assert "n_predict must be between -1 and 1073741824, got -7" in resp.meta["error"]
        ok = (await c.call(configure_call(0, {"temperature": 0.0, "top_k": 5, "batch": 64}))).meta
        assert ok["params_applied"] == {"temperature": 0.0, "top_k": 5}
        assert "batch" in ok["params_unused"]
        # A later DECODE on the slot that sets nothing of its own still works.
        assert (await decode(c, 0, frame(MESSAGES, n_predict=2))).ok


async def test_head_of_an_admin_route_needs_the_admin_key(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, api_key="plain-key", admin_api_key="admin-key", **ENGINE)
    async with http(ep, api_key="plain-key") as h:
        assert (await h.head("/v1/decode")).status_code == 403
        assert (await h.get("/v1/decode")).status_code == 403
    async with http(ep, api_key="admin-key") as h:
        assert (await h.head("/v1/decode")).status_code == 200


async def test_a_lease_refuses_use_after_its_release(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, **ENGINE)
    engine = ep.state.engine
    async with engine.claim("test", slot=1) as lease:
        assert engine.slot_info(1).busy
    assert not engine.slot_info(1).busy
    with pytest.raises(RuntimeError, match="after its release"):
        await lease.clear()
