"""Agent sessions end to end (docs/operations.md, "Agent sessions"): ``POST /finish_session``
releases a tree's KV and cuts its live requests, a parent's cancellation stops its subagents'
decodes within one step, a deadline is a cancel scope's, and every cut turn has a receipt in
its reply, its decode record and its log line."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from helpers import MESSAGES, decode_ok, frame, gate, http, rpc, scrape, wait_until

PROMPT = "the agent reads the repository and plans its next change " * 6
ROOT = {"x-claude-code-session-id": "S"}
SUB = {**ROOT, "x-claude-code-agent-id": "sub-1"}


async def _complete(h: Any, headers: dict[str, str], prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    r = await h.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}, headers=headers
    )
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _stream_until_cut(
    h: Any, headers: dict[str, str], started: trio.Event, out: dict[str, Any], **extra: Any
) -> None:
    """A long stream (ignore_eos): ``started`` once a token came; ``out`` gets its last event."""
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True, **extra}
    async with h.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"][0].get("text"):
                started.set()
            if event["choices"][0].get("finish_reason") is not None:
                out.update(event)


async def test_finish_session_cuts_the_tree_and_releases_its_kv(
    start_engine: Callable[..., Any], tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ep = await start_engine(tiny_model, slots=3, cache_ram_mib=64)
    async with http(ep) as h:
        first = await _complete(h, ROOT)
        n = first["usage"]["prompt_tokens"]
        assert _cached(await _complete(h, ROOT)) >= n - 1  # its history is kept
        last: dict[str, Any] = {}
        started = trio.Event()
        caplog.clear()
        with caplog.at_level("INFO", logger="hydra_trio"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(_stream_until_cut, h, SUB, started, last, prompt="a subagent's own task " * 20)
                )
                await started.wait()
                r = await h.post("/finish_session", params={"session_id": "S:lead"})
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["found"] and done["sessions"] == 2 and done["cancelled_requests"] == 1
        assert done["released"]["slots"] >= 1
        # The subagent's stream ended with its receipt: cut by the finish, nothing kept.
        choice = last["choices"][0]
        assert choice["finish_reason"] == "abort"
        receipt = last["receipt"]
        assert receipt["cut"] == "finish_session" and receipt["session_id"] == "S:sub-1"
        assert receipt["kept"] == {"n_past": 0, "tier": "released"}
        assert receipt["completion_tokens"] == last["usage"]["completion_tokens"] > 0
        assert receipt["prompt_tokens_computed"] == last["usage"]["prompt_tokens"]
        (line,) = [
            r.request
            for r in caplog.records
            if getattr(r, "request", None) and r.request.get("session_id") == "S:sub-1"
        ]
        assert line["status"] == "cancelled" and line["receipt"] == receipt and line["finish_reason"] == "abort"
        # Released at once: the root's next turn recomputes its history.
        assert _cached(await _complete(h, ROOT)) == 0
        again = await h.post("/finish_session", json={"session_id": "S:lead"})  # idempotent; a JSON body works too
        assert again.status_code == 200 and again.json()["found"] is True  # the turn above named it anew
        assert (await h.post("/finish_session", params={"session_id": "S:lead"})).json()["found"] is False
        bad = await h.post("/finish_session")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
        m = await scrape(h)
        assert m[("hydra_session_trees_finished_total", ())] == 2
        assert m[("hydra_session_turns_cut_total", ())] >= 1


async def test_a_parent_cancelled_stops_its_subagents_decodes_within_one_step(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """Three DECODEs in one engine: a parent, its subagent, and that one's subagent. With the
    GPU worker held (no step can run), the parent is DELETEd: its subagents are cut in the
    same pass, and at most the one step already composed runs before all three have ended."""
    ep = await start_engine(tiny_model, slots=3)
    engine = ep.state.engine
    async with http(ep) as h, await rpc(ep) as c:
        rids = {}
        for slot, (name, parent) in enumerate((("root", None), ("a", "root"), ("b", "a"))):
            context = {"program_id": name, **({"parent_program_id": parent} if parent else {})}
            rids[name] = await decode_ok(
                c, slot, frame(MESSAGES, n_predict=1500, ignore_eos=True, vllm_xargs={"agentic_context": context})
            )
        for rid in rids.values():
            await wait_until(lambda rid=rid: _generated(ep, rid) > 2)
        entries = {name: ep.state.decodes.lookup(rid) for name, rid in rids.items()}  # kept: they outlive the store
        async with gate(ep) as g, trio.open_nursery() as nursery:
            # The worker is held: once every task has taken the last step's token, nothing moves.
            await trio.testing.wait_all_tasks_blocked(cushion=0.02)
            before = {name: e.result.completion_tokens for name, e in entries.items()}
            deleted: dict[str, Any] = {}

            async def delete_root() -> None:
                deleted.update((await h.delete(f"/v1/decode/{rids['root']}")).json())

            nursery.start_soon(delete_root)
            calls = 0
            with trio.fail_after(20):
                while not all(_ended(ep, rid) for rid in rids.values()):
                    await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                    if g.waiting and not all(_ended(ep, rid) for rid in rids.values()):
                        await g.step(1)  # one llama.cpp call, then the worker is held again
                        calls += 1
        # At most the step composed before the DELETE ran for them: one token each.
        assert calls <= 1
        for name in ("a", "b"):
            assert entries[name].result.completion_tokens - before[name] <= 1
            r = await h.get(f"/v1/decode/{rids[name]}")
            assert r.status_code == 410 and r.json()["state"] == "cancelled"
            assert r.json()["receipt"]["cut"] == "parent_cancelled" and r.json()["receipt"]["session_id"] == name
        assert deleted["cancelled"] is True and deleted["receipt"]["cut"] == "delete"
        assert engine.stats().slots_busy == 0


def _ended(ep: Any, rid: int) -> bool:
    entry = ep.state.decodes.lookup(rid)
    return entry is None or not getattr(entry, "running", False)


async def test_a_deadline_cuts_the_turn_and_a_later_turn_continues_what_it_kept(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h:
        context = {"program_id": "job-1", "deadline_seconds": 1.0}
        last: dict[str, Any] = {}
        started = trio.Event()
        async with gate(ep, closed=False) as g, trio.open_nursery() as nursery:
            t0 = trio.current_time()
            nursery.start_soon(
                partial(_stream_until_cut, h, {}, started, last, vllm_xargs={"agentic_context": context})
            )
            await started.wait()  # it generates; then the worker is held past its deadline
            await g.close()
            await trio.sleep_until(t0 + 1.2)
            g.open()
        receipt = last["receipt"]
        assert last["choices"][0]["finish_reason"] == "abort" and receipt["cut"] == "deadline"
        assert receipt["session_id"] == "job-1"
        n_prompt, n_gen = last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]
        assert 0 < n_gen < 1500 and receipt["completion_tokens"] == n_gen
        assert receipt["prompt_tokens_computed"] == n_prompt - _cached(last)
        # The slot keeps the prompt and what was generated (the last token sampled is not in it yet).
        assert (
            receipt["kept"]["tier"] == "slot" and n_prompt + n_gen - 1 <= receipt["kept"]["n_past"] <= n_prompt + n_gen
        )
        text = (await _complete(h, {}, max_tokens=n_gen, ignore_eos=True))["choices"][0]["text"]  # the same greedy text
        again = await _complete(h, {"x-session-id": "job-1"}, prompt=PROMPT + text)
        assert _cached(again) >= n_prompt  # it continues what the cut turn kept


async def test_a_deleted_decode_has_a_receipt_in_its_record(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h, await rpc(ep) as c:
        rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=1500, ignore_eos=True, prompt_cache_key="conv-1"))
        await wait_until(lambda: _generated(ep, rid) > 2)
        d = await h.delete(f"/v1/decode/{rid}")
        assert d.status_code == 200 and d.json()["cancelled"] is True
        receipt = d.json()["receipt"]
        assert receipt["cut"] == "delete" and receipt["session_id"] == "conv-1"
        assert receipt["completion_tokens"] == d.json()["completion_tokens"] > 0
        assert receipt["kept"]["tier"] == "slot" and receipt["kept"]["n_past"] > 0
        r = await h.get(f"/v1/decode/{rid}")
        assert r.status_code == 410 and r.json()["receipt"] == receipt


def _generated(ep: Any, rid: int) -> int:
    entry = ep.state.decodes.lookup(rid)
    res = getattr(entry, "result", None)
    return 0 if res is None else res.completion_tokens

