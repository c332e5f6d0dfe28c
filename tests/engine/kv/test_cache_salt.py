"""vLLM's ``cache_salt``: KV computed under one salt is reused only by requests with the same
salt, in the slots, in the host prompt cache and in the KV events' block hashes, and
``cached_tokens`` tells nothing of another salt's prompts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import http
from hydra_trio.engine.kv import PromptCache, SlotBlocks
from hydra_trio.engine.kv.blocks import block_hash
from hydra_trio.engine.llama import Snapshot

PROMPT = "tell me about the river and the old mill and why they matter " * 4


def _cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _complete(
    h: Any, route: str, salt: str | None, *, headers: dict[str, str] | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 2, "temperature": 0, **extra}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    if salt is not None:
        body["cache_salt"] = salt
    r = await h.post("/v1/chat/completions" if route == "chat" else "/v1/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_another_salt_reuses_nothing_the_same_salt_reuses(
    start_engine: Callable[..., Any], tiny_model: Path, route: str
) -> None:
    """One slot, so every request lands on the same KV; the host cache keeps what a salt
    change drops. Each salt (and no salt) reuses its own history only."""
    ep = await start_engine(tiny_model, slots=1, ctx_size=2048, cache_ram_mib=64)
    async with http(ep) as h:
        first = await _complete(h, route, "tenant-a")
        n = first["usage"]["prompt_tokens"]
        assert _cached(first) == 0
        again = await _complete(h, route, "tenant-a")
        assert _cached(again) >= n - 1  # the slot's history, under the same salt
        other = await _complete(h, route, "tenant-b")
        assert _cached(other) == 0  # the same prompt under another salt: nothing reused
        assert _cached(await _complete(h, route, None)) == 0  # nor unsalted
        # Each history comes back from the host cache, to its own salt only.
        assert _cached(await _complete(h, route, "tenant-a")) >= n - 1
        assert _cached(await _complete(h, route, "tenant-b")) >= n - 1
        assert _cached(await _complete(h, route, None)) >= n - 1


async def test_two_slots_each_salt_takes_its_own(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """With a free slot, the other salt's request takes it: the first salt's slot stays."""
    ep = await start_engine(tiny_model, cache_ram_mib=0)
    async with http(ep) as h:
        a = await _complete(h, "completions", "a")
        b = await _complete(h, "completions", "b")
        assert _cached(b) == 0 and a["id_slot"] != b["id_slot"]
        a2 = await _complete(h, "completions", "a")
        assert a2["id_slot"] == a["id_slot"] and _cached(a2) >= a["usage"]["prompt_tokens"] - 1


@pytest.mark.parametrize("salt", ["", 7, ["a"], "x" * 257])
async def test_a_bad_salt_is_refused(start_engine: Callable[..., Any], tiny_model: Path, salt: Any) -> None:
    ep = await start_engine(tiny_model)
    async with http(ep) as h:
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ):
            r = await h.post(path, json={**body, "cache_salt": salt})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "cache_salt"


def _snap(tokens: list[int], salt: str | None) -> Snapshot:
    return Snapshot(tokens, bytearray(100), 8, False, salt)


def test_the_prompt_cache_keeps_each_salts_entries_apart() -> None:
    cache = PromptCache(10_000)
    prompt = list(range(40))
    assert cache.put(_snap(prompt[:30], "a"))
    assert cache.best(prompt, "b") is None
    assert cache.best(prompt, None) is None
    hit = cache.best(prompt, "a")
    assert hit is not None and hit.n_common == 30
    # Entries of neighbouring salts (sorted right before and after) are not prefixes either.
    assert cache.put(_snap(prompt[:35], "b"))
    assert cache.put(_snap(prompt[:20], None))
    assert cache.put(_snap(prompt[:10], "c"))
    assert len(cache) == 4  # an equal prefix under another salt replaces nothing
    for salt, n in (("a", 30), ("b", 35), (None, 20), ("c", 10)):
        found = cache.best(prompt, salt)
        assert found is not None and found.n_common == n, salt
    assert cache.best(prompt, "ab") is None
    # A longer entry of "a" replaces "a"'s own prefix only.
    assert cache.put(_snap(prompt, "a"))
    assert len(cache) == 4
    found = cache.best(prompt, "a")
    assert found is not None and found.n_common == 40
    snap = cache.take(found.key)
    assert snap.salt == "a" and cache.best(prompt, "a") is None


def test_the_salt_is_mixed_into_the_first_blocks_hash() -> None:
    """As vLLM does: the same tokens under two salts make two chains (the first block's
    hash differs, hence every later one), unsalted ones the chain they always made."""
    tokens = list(range(48))
    hashes: dict[str | None, list[int]] = {}
    for salt in (None, "a", "b"):
        sb = SlotBlocks(1, 16)
        sb.slot_changed(0, tokens, 0, salt)
        (stored,) = sb.take()
        assert stored["parent_block_hash"] is None and stored["token_ids"] == tokens
        hashes[salt] = stored["block_hashes"]
    assert hashes[None][0] == block_hash(None, tokens[:16])
    assert len({h for chain in hashes.values() for h in chain}) == 9  # no block shared
    # Two slots holding the same tokens under two salts hold no block in common.
    sb = SlotBlocks(2, 16)
    sb.slot_changed(0, tokens, 0, "a")
    sb.slot_changed(1, tokens, 0, "b")
    assert sorted(sb.held().values()) == [1] * 6


# ---- agent sessions: a salt is a tenant ---------------------------------------------------------


async def _live_child(
    h: Any, headers: dict[str, str], salt: str | None, out: dict[str, Any], started: trio.Event
) -> None:
    """A stream of a subagent of ``headers``'s session under ``salt``; ``out`` gets its end."""
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    async with h.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                started.set()
                if event["choices"][0].get("finish_reason"):
                    out.update(event)


async def test_a_salt_cannot_pin_read_release_or_cancel_another_salts_session(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """Tenants a and b (two salts) name the same session ids. What b says of "s" (a high
    priority, a long retention), b's finish of "s", b's cancelled "root" reach b's own
    sessions only: a's session keeps its settings, its KV and its live subagent; and b learns
    nothing of a's (no cached token)."""
    ep = await start_engine(tiny_model, slots=3, cache_ram_mib=64)
    sessions = ep.state.engine._core.sessions
    s = {"x-session-id": "s"}
    async with http(ep) as h:
        first = await _complete(h, "completions", "a", headers=s)
        n = first["usage"]["prompt_tokens"]
        pin = {"vllm_xargs": {"agentic_context": {"priority": 1000, "kv_retention_ttl_seconds": 604800}}}
        other = await _complete(h, "completions", "b", headers=s, **pin)
        assert _cached(other) == 0  # read, time: nothing of a's
        mine = sessions.get(("open", "a", "s"))
        assert mine is not None and (mine.priority, mine.ttl_s) == (0, 300.0)  # pin: untouched
        done = (await h.post("/finish_session", params={"session_id": "s", "cache_salt": "b"})).json()
        assert done["found"] and done["sessions"] == 1  # b's own
        assert sessions.get(("open", "a", "s")) is mine and not mine.released
        assert _cached(await _complete(h, "completions", "a", headers=s)) >= n - 1  # release: a's KV kept
        # a's live subagent under "root"; b's "root" is cancelled (its deadline) and finished.
        out: dict[str, Any] = {}
        started = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _live_child, h, {"x-session-id": "child", "x-parent-session-id": "root"}, "a", out, started
            )
            await started.wait()
            cut = {"vllm_xargs": {"agentic_context": {"program_id": "root", "deadline_seconds": 0}}}
            b_root = await _complete(h, "completions", "b", **cut)
            assert b_root["choices"][0]["finish_reason"] == "abort" and b_root["receipt"]["cut"] == "deadline"
            assert (await h.post("/finish_session", json={"session_id": "root", "cache_salt": "b"})).json()["found"]
            assert (await h.post("/finish_session", json={"session_id": "child", "cache_salt": "b"})).json()[
                "found"
            ] is False
        assert out["choices"][0]["finish_reason"] == "length" and "receipt" not in out  # a's ran to its end
