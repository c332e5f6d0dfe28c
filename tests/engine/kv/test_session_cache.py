"""An engine keeps its chat sessions' KV: slot choice by prompt similarity (a shared chat
template head does not make a session overwrite another's history), and the host-memory
prompt cache that keeps histories past the slots (--cache-ram-mib)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import http, scrape
from hydra_trio.engine.kv import PromptCache
from hydra_trio.engine.llama import Snapshot, common_prefix_len

N = 8


def _session(i: int) -> list[dict[str, str]]:
    topic = ["the river", "a red kite", "seven owls", "the old mill", "winter bread", "a lost key"][i]
    return [{"role": "user", "content": f"tell me about {topic} and why it matters " * 3}]


async def _turn(h: Any, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """One chat turn; the conversation extended with the answer and a follow-up question."""
    r = await h.post("/v1/chat/completions", json={"messages": messages, "max_tokens": N, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    answer = body["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}], body


def _cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_sessions_keep_their_own_slots(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """Two sessions on two slots: the second takes the empty slot although the first's slot
    shares the chat template's head with it, so each next turn finds its whole history."""
    ep = await start_engine(tiny_model, cache_ram_mib=0)
    async with http(ep) as h:
        a, first_a = await _turn(h, _session(0))
        b, first_b = await _turn(h, _session(1))
        assert first_a["id_slot"] != first_b["id_slot"]
        for conv, first in ((a, first_a), (b, first_b)):
            _, again = await _turn(h, conv)
            assert again["id_slot"] == first["id_slot"]
            assert _cached(again) >= first["usage"]["prompt_tokens"]


async def test_a_history_past_the_slots_comes_back_from_host_memory(
    start_engine: Callable[..., Any], tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three sessions on two slots: the third takes the least recently used slot, whose
    history goes to the prompt cache first and comes back, exact, for that session's next
    turn (its request line says how much came from RAM). Without the cache the turn
    recomputes its history."""
    for cache_mib in (64, 0):
        ep = await start_engine(tiny_model, cache_ram_mib=cache_mib)
        async with http(ep) as h:
            convs, firsts = [], []
            for i in range(3):
                conv, body = await _turn(h, _session(i))
                convs.append(conv)
                firsts.append(body)
            assert firsts[2]["id_slot"] == firsts[0]["id_slot"]  # the least recently used
            caplog.clear()
            with caplog.at_level("INFO", logger="hydra_trio"):
                _, again = await _turn(h, convs[0])
            (line,) = [
                r.request for r in caplog.records if getattr(r, "request", None) and r.request["route"] == "chat"
            ]
            assert line["host_cached_tokens"] == (_cached(again) if cache_mib else 0)
            if cache_mib:
                assert _cached(again) >= firsts[0]["usage"]["prompt_tokens"]
                m = await scrape(h)
                assert m[("hydra_prompt_cache_restored_total", ())] >= 1
                assert m[("hydra_prompt_cache_restored_tokens_total", ())] >= firsts[0]["usage"]["prompt_tokens"]
                assert m[("hydra_prompt_cache_saved_total", ())] >= 1
                assert m[("hydra_prompt_cache_bytes", ())] > 0
            else:
                assert _cached(again) < firsts[0]["usage"]["prompt_tokens"] // 2


def _snap(tokens: list[int], size: int = 100) -> Snapshot:
    return Snapshot(tokens, bytearray(size), 8, False)


def test_prompt_cache_bounds_bytes_and_keeps_the_longest_history() -> None:
    cache = PromptCache(max_bytes=250)
    assert cache.put(_snap([1, 2, 3]))
    assert cache.put(_snap([1, 2, 3, 4, 5]))  # extends the first: replaces it
    assert len(cache) == 1 and cache.evicted == 1
    assert cache.put(_snap([7, 8]))
    assert cache.put(_snap([9]))  # 300 bytes would not fit: the oldest goes
    assert len(cache) == 2 and cache.nbytes == 200
    assert cache.best([1, 2, 3]) is None
    assert not cache.put(_snap([5], size=251))  # larger than the whole cache
    hit = cache.best([7, 8, 1])
    assert hit is not None and hit.n_common == 2
    snap = cache.take(hit.key)
    assert snap.tokens == [7, 8] and len(cache) == 1 and cache.restored_tokens == 2
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
    # An entry between a prefix and its extension in token order ([1] < [1, 0, 5] < [1, 2])
    # does not hide the prefix from the put that extends it.
    cache = PromptCache(max_bytes=1000)
    for tokens in ([1, 0, 5], [1], [1, 2]):
        assert cache.put(_snap(tokens))
    assert sorted(s.tokens for s in cache._entries.values()) == [[1, 0, 5], [1, 2]]


# Few distinct tokens and short sequences: prefixes, extensions and near misses are common.
_seqs = st.lists(st.integers(0, 2), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "best", "take"]), _seqs), max_size=40))
def test_prompt_cache_lookups_match_a_scan_of_every_entry(ops: list[tuple[str, list[int]]]) -> None:
    """The cache's order by tokens gives what scanning every entry gives: the longest shared
    prefix, and on a put, the entries the new one extends dropped, the rest kept."""
    cache = PromptCache(max_bytes=1 << 30)
    model: dict[int, list[int]] = {}  # what a scan of every entry would see
    for op, tokens in ops:
        if op == "put":
            assert cache.put(_snap(tokens))
            model = {k: t for k, t in model.items() if t != tokens[: len(t)]}
            model[max(cache._entries)] = list(tokens)
            assert {k: s.tokens for k, s in cache._entries.items()} == model
        else:
            hit = cache.best(tokens)
            want = max((common_prefix_len(t, tokens) for t in model.values()), default=0)
            assert (hit.n_common if hit else 0) == want
            if hit:
                assert common_prefix_len(model[hit.key], tokens) == want
                if op == "take":
                    assert cache.take(hit.key).tokens == model.pop(hit.key)
    assert len(cache) == len(model)
