"""Retention by session, not by recency (engine/kv/retention.py): the eviction order the
prompt cache (RAM), the slots and the disk tier share, and what it keeps for a parent
whose subagents fill the cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import http, scrape
from hydra_trio.engine.kv import PromptCache, Retention
from hydra_trio.engine.kv.retention import EXPIRED, FINISHED, LIVE, ONE_OFF
from hydra_trio.engine.llama import Snapshot


@dataclass(eq=False)
class Owner:
    seq: int
    priority: int = 0
    last_active: float = 0.0
    is_finished: bool = False
    ttl: float = 100.0
    live: bool = False
    parent: Owner | None = None
    gap: float | None = None  # its usual gap between turns
    waits: bool = False  # on subagents still working

    def finished(self) -> bool:
        return self.is_finished

    def expired(self, now: float) -> bool:
        return not self.live and now > self.last_active + self.ttl

    def running(self) -> bool:
        return self.live

    def waiting(self) -> bool:
        return self.waits

    def usual_gap(self) -> tuple[float | None, float | None]:
        return self.last_active, self.gap


def _snap(tokens: list[int], size: int = 100) -> Snapshot:
    return Snapshot(tokens, bytearray(size), 0, False)


def test_the_order_finished_then_one_off_then_expired_then_live() -> None:
    now = [1000.0]
    ret = Retention("session", lambda: now[0])
    finished = Owner(seq=9, is_finished=True, last_active=999)
    expired = Owner(seq=1, last_active=0)  # idle past its TTL
    waiting = Owner(seq=2, last_active=990, waits=True)  # a parent whose subagents work
    soon = Owner(seq=3, last_active=997, gap=5)  # its tool runs: back at 1002
    later = Owner(seq=6, last_active=999, gap=5)  # back at 1004
    lapsed = Owner(seq=7, last_active=970, gap=5)  # idle 30 s at a 5 s pace: back at 1030, if ever
    running = Owner(seq=8, last_active=999, live=True)
    important = Owner(seq=4, priority=5, last_active=900, gap=5)
    sub = Owner(seq=5, last_active=998, parent=waiting, gap=5)  # back at 1003
    assert [ret.kind(o) for o in (finished, None, expired, soon)] == [FINISHED, ONE_OFF, EXPIRED, LIVE]
    order = sorted([important, running, sub, soon, waiting, lapsed, later, expired, None, finished], key=ret.rank)
    # Among live sessions: lower priority first, then the parent that waits on its subagents,
    # then the one whose next turn is expected last (one lapsed past twice its pace: as
    # long again as it has been idle); one whose turn runs last.
    assert order == [finished, None, expired, waiting, lapsed, later, sub, soon, running, important]
    # Recency alone: every owner ranks alike.
    lru = Retention("lru", lambda: now[0])
    assert len({lru.rank(o) for o in order}) == 1


def test_the_cache_evicts_by_the_order_and_spills_what_it_keeps() -> None:
    ret = Retention("session", lambda: 0.0)
    spilled: list[tuple[list[int], Any]] = []
    cache = PromptCache(300, ret, spill=lambda snap, owner: spilled.append((snap.tokens, owner)))
    parent, sub = Owner(seq=0), Owner(seq=1)
    cache.put(_snap([1, 2]), parent)  # the parent's history, put first (least recently)
    cache.put(_snap([3, 4]), sub)
    cache.put(_snap([5, 6]), None)  # a one-off prompt
    cache.put(_snap([7, 8]), sub)  # room: the one-off goes, not the parent's (recency would drop it)
    assert sorted(s.tokens for _, s in cache.items()) == [[1, 2], [3, 4], [7, 8]]
    assert spilled == [([5, 6], None)]
    assert ret.evictions[("ram", ONE_OFF)] == 1
    sub.is_finished = True  # its parent went on: its copies go first, and are not spilled
    cache.put(_snap([9, 9]), None)
    assert sorted(s.tokens for _, s in cache.items()) == [[1, 2], [7, 8], [9, 9]]
    assert ret.evictions[("ram", FINISHED)] == 1 and len(spilled) == 1
    assert cache.drop_owned({parent}) == 1  # the parent's tree was finished: released at once
    assert sorted(s.tokens for _, s in cache.items()) == [[7, 8], [9, 9]]
    assert cache.nbytes == 200


def test_lru_is_the_order_before_sessions() -> None:
    cache = PromptCache(200, Retention("lru", lambda: 0.0))
    parent = Owner(seq=0)
    cache.put(_snap([1]), parent)
    cache.put(_snap([2]), None)
    cache.put(_snap([3]), None)  # the least recently put goes, whoever owns it
    assert sorted(s.tokens for _, s in cache.items()) == [[2], [3]]


def _session_headers(session: str, agent: str | None = None) -> dict[str, str]:
    headers = {"x-claude-code-session-id": session}
    if agent is not None:
        headers["x-claude-code-agent-id"] = agent
    return headers


async def _turn(h: Any, text: str, headers: dict[str, str], **extra: Any) -> dict[str, Any]:
    r = await h.post(
        "/v1/completions", json={"prompt": text, "max_tokens": 1, "temperature": 0, **extra}, headers=headers
    )
    assert r.status_code == 200, r.text
    return r.json()


async def test_subagents_do_not_push_out_the_history_their_parent_waits_on(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """One slot and a prompt cache that holds the parent's history and three subagents': a
    parent's long history, then five subagents' one-turn tasks, each saying it was its last
    (``expected_resume: false``, as vllm-router's blocking subagents do). The fifth's turn
    puts the fourth's history where four do not fit beside the parent's: under recency the
    parent's leaves RAM and its next turn recomputes it; by session the finished subagents'
    copies leave first. (A turn takes its entry out of RAM before the slot's history goes in:
    the parent's next turn alone would not fill the cache.)"""
    # ~1700 and ~600 tokens on the tiny model (~270 bytes a position): a 1 MiB cache holds the
    # parent's history and three subagents'.
    parent = "the parent agent's system prompt and tools and its long history " * 40
    cached: dict[str, int] = {}
    for policy in ("lru", "session"):
        ep = await start_engine(tiny_model, slots=1, session_policy=policy, cache_ram_mib=1)
        async with http(ep) as h:
            first = await _turn(h, parent, _session_headers("S"))
            last = {"vllm_xargs": {"agentic_context": {"expected_resume": False}}}
            for i in range(5):  # the subagents' work, each a fresh prompt
                await _turn(h, f"subagent {i} explores "
                            f"file number {i} " * 20, _session_headers("S", f"sub-{i}"), **last)
            again = await _turn(h, parent + " and the results", _session_headers("S"))
            cached[policy] = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            m = await scrape(h)
            assert m[("hydra_prompt_cache_evicted_total", ())] >= 1  # the cache was full
            assert first["usage"]["prompt_tokens"] > 1000
    assert cached["session"] >= first["usage"]["prompt_tokens"] - 1
    assert cached["lru"] < first["usage"]["prompt_tokens"] // 2


async def test_a_history_another_request_borrows_stays_its_sessions(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """Session b's prompt shares session a's first part: b's turn borrows a's history from RAM
    (into its slot), keeps that part and puts a's history back; the copy is still a's (not the
    slot's last owner's), so the retention order ranks it as a's."""
    ep = await start_engine(tiny_model, slots=1, cache_ram_mib=64)
    cache = ep.state.engine._core.prompt_cache
    shared = "the system prompt and the tools every session of this agent shares " * 10
    async with http(ep) as h:
        a = await _turn(h, shared + "and session a's own task " * 10, {"x-session-id": "a"})
        await _turn(h, "an unrelated one-off prompt about something else entirely " * 6, {})  # a's history to RAM
        b = await _turn(h, shared + "and session b's own different task " * 10, {"x-session-id": "b"})
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shared.split()) // 2  # a's first part
    (owner,) = [cache.owner_of(k) for k, snap in cache.items() if len(snap.tokens) >= a["usage"]["prompt_tokens"]]
    assert owner is not None and owner.id == "a"
