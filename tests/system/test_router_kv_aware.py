"""vllm-router 0.1.17's ``--policy kv_aware`` over three hydra engines that publish KV
events (--kv-events-endpoint): each chat turn goes to the engine that holds its history,
and an engine that drops a history (or restarts) keeps no credit for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

from helpers import http, wait_slots_idle, wait_until
from routers import Router, free_port, launch_router, needs_router

pytestmark = needs_router
N = 8
CHAT = "/v1/chat/completions"


def url(ep: Any) -> str:
    return f"http://127.0.0.1:{ep.http_port}"


def kv_aware_args(eps: list[Any]) -> list[str]:
    args = ["--policy", "kv_aware", "--worker-urls", *map(url, eps), "--kv-event-model", "tiny"]
    for ep in eps:
        pub = ep.state.kv_events
        args += [
            "--kv-event-source",
            f"{url(ep)}={pub.endpoint}",
            "--kv-event-replay-source",
            f"{url(ep)}={pub.replay_endpoint}",
        ]
    return args


async def kv_engines(start_engine: Callable[..., Any], model: Path, n: int = 3, **kw: Any) -> list[Any]:
    events = {"kv_events_endpoint": "tcp://127.0.0.1:0", "kv_events_replay_endpoint": "tcp://127.0.0.1:0"}
    return [await start_engine(model, slots=2, ctx_size=2048, cache_ram_mib=0, **events, **kw) for _ in range(n)]


async def synced(router: Router, eps: list[Any]) -> None:
    """Wait until every engine has published what its slots hold and the router's index has
    applied all of it (routing before that would race the events)."""
    for ep in eps:
        eng = ep.state.engine
        await wait_slots_idle(eng)
        async with eng._core.worker.limiter:  # every GPU-worker call so far has run ...
            pass
    await trio.testing.wait_all_tasks_blocked()  # ... and its caller has published its events
    for ep in eps:
        last = ep.state.kv_events.next_seq - 1
        await wait_until(lambda ep=ep, last=last: router.applied_seq(url(ep)) >= last, 30.0)


def served(ep: Any) -> float:
    return (
        ep.state.metrics.registry.get_sample_value("hydra_http_requests_total", {"route": CHAT, "status": "200"}) or 0.0
    )


async def turn(client: Any, conv: list[dict[str, str]], eps: list[Any]) -> tuple[int, dict[str, Any]]:
    """One chat turn: (index of the engine that served it, the reply); ``conv`` is extended
    with the answer and a next question."""
    before = [served(ep) for ep in eps]
    r = await client.post(CHAT, json={"model": "tiny", "messages": conv, "max_tokens": N, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    (where,) = [i for i, ep in enumerate(eps) if served(ep) > before[i]]
    conv += [
        {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
        {"role": "user", "content": f"and then, after {len(conv)}?"},
    ]
    return where, body


def cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def session(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"session {i} is about subject number {i} and all it touches " * 4}]


async def test_each_turn_goes_where_its_history_is_cached(
    nursery: trio.Nursery, tmp_path: Path, start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    eps = await kv_engines(start_engine, tiny_model)
    router = await launch_router(nursery, tmp_path, kv_aware_args(eps))
    convs = [session(i) for i in range(6)]
    last_prompt = []
    for i, conv in enumerate(convs):  # first turns straight at engine i % 3: two sessions each
        async with http(eps[i % 3]) as h:
            last_prompt.append((await turn(h, conv, eps))[1]["usage"]["prompt_tokens"])
    async with router.client() as c:
        for _ in range(2):
            for i, conv in enumerate(convs):
                await synced(router, eps)
                where, body = await turn(c, conv, eps)
                assert where == i % 3, f"session {i}'s turn went to engine {where}, its history is on {i % 3}"
                assert cached(body) >= last_prompt[i]  # the whole previous prompt, at least
                last_prompt[i] = body["usage"]["prompt_tokens"]


async def test_an_engine_that_dropped_a_history_gets_no_credit_for_it(
    nursery: trio.Nursery, tmp_path: Path, start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    eps = await kv_engines(start_engine, tiny_model, n=2)
    router = await launch_router(nursery, tmp_path, kv_aware_args(eps))
    conv = session(7)
    async with http(eps[1]) as h:  # engine 1 holds the first turn only ...
        await turn(h, list(conv), eps)
    async with http(eps[0]) as h:  # ... engine 0 two turns
        await turn(h, conv, eps)
        await turn(h, conv, eps)
    async with router.client() as c:
        await synced(router, eps)
        where, _ = await turn(c, list(conv), eps)  # a copy: the same history again next
        assert where == 0  # the longer history wins
        # Engine 0 drops the history: its slot erased, a BlockRemoved for every block.
        eng0 = eps[0].state.engine
        (slot,) = [s for s in range(2) if eng0._core.n_past(s)]
        async with http(eps[0]) as h:
            assert (await h.post(f"/slots/{slot}?action=erase")).status_code == 200
        await synced(router, eps)
        where, body = await turn(c, conv, eps)
        assert where == 1, "the router still credited engine 0 with a history it dropped"
        assert cached(body) > 0


async def test_a_restarted_engine_gets_no_credit_for_what_it_held(
    nursery: trio.Nursery,
    tmp_path: Path,
    start_engine: Callable[..., Any],
    run_engine: Callable[..., Any],
    tiny_model: Path,
) -> None:
    """Engine 1 restarts on the same ports: its seq starts at 0 again, which the router reads
    as a restart (it drops engine 1's blocks), and its new subscription brings a resync."""
    (e0,) = await kv_engines(start_engine, tiny_model, n=1)
    fixed = {
        "port": free_port(),
        "rpc_port": free_port(),
        "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "slots": 2,
        "ctx_size": 2048,
        "cache_ram_mib": 0,
    }
    conv = session(9)
    async with http(e0) as h:  # engine 0 holds the first turn only
        await turn(h, list(conv), [e0])
    async with run_engine(tiny_model, **fixed) as e1:
        eps = [e0, e1]
        router = await launch_router(nursery, tmp_path, kv_aware_args(eps))
        async with http(e1) as h:  # engine 1 two turns
            await turn(h, conv, [e1])
            await turn(h, conv, [e1])
        async with router.client() as c:
            await synced(router, eps)
            where, _ = await turn(c, list(conv), eps)
            assert where == 1
            await synced(router, eps)
    async with run_engine(tiny_model, **fixed) as e1:  # the same ports, nothing held
        eps = [e0, e1]
        await wait_until(lambda: "restart seq" in router.log.read_text(errors="replace"), 30.0)
        await synced(router, eps)
        async with router.client() as c:
            where, body = await turn(c, conv, eps)
        assert where == 0, "the router still credited the restarted engine with what it held before"
        assert cached(body) > 0


async def test_pd_mode_sends_each_prefill_where_its_history_is_cached(
    nursery: trio.Nursery, tmp_path: Path, start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """P/D: two prefill engines publish KV events (--pd-kv-events), one decode engine. A
    conversation's prefill goes to the prefill engine that holds its history."""
    prefills = await kv_engines(start_engine, tiny_model, n=2)
    decode = await start_engine(tiny_model, slots=2, ctx_size=2048)
    args = ["--vllm-pd-disaggregation", "--decode", url(decode)]
    for ep in prefills:  # one --prefill per engine (a second value would be a bootstrap port)
        args += ["--prefill", url(ep)]
    args += ["--prefill-policy", "kv_aware", "--decode-policy", "round_robin", "--kv-event-model", "tiny"]
    for ep in prefills:
        args += ["--pd-kv-events", f"{url(ep)}={ep.state.kv_events.endpoint}"]
    router = await launch_router(nursery, tmp_path, args)
    convs = [session(20), session(21)]
    for i, conv in enumerate(convs):  # conversation i's first turn straight at prefill engine i
        async with http(prefills[i]) as h:
            await turn(h, conv, prefills)
    async with router.client() as c:
        for _ in range(2):
            for i, conv in enumerate(convs):
                await synced(router, prefills)
                where, body = await turn(c, conv, prefills)
                assert where == i, f"conversation {i}'s prefill went to engine {where}"
                assert body["kv_transfer"]["status"] == "restored"


async def test_a_history_moved_to_ram_is_credited_to_its_engine(
    nursery: trio.Nursery, tmp_path: Path, start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """Host prompt-cache blocks (medium CPU) reach the router's index: engine 0's one slot
    moved session 7's two turns to RAM when session 8 came, engine 1's slot holds its first
    turn only. The router sends the next turn to engine 0, which serves it from RAM."""
    events = {"kv_events_endpoint": "tcp://127.0.0.1:0", "kv_events_replay_endpoint": "tcp://127.0.0.1:0"}
    eps = [await start_engine(tiny_model, slots=1, ctx_size=2048, cache_ram_mib=64, **events) for _ in range(2)]
    router = await launch_router(nursery, tmp_path, kv_aware_args(eps))
    conv = session(7)
    async with http(eps[1]) as h:
        await turn(h, list(conv), eps)  # engine 1: the first turn, in its slot
    async with http(eps[0]) as h:
        await turn(h, conv, eps)
        conv[-1]["content"] += " tell me much more about every part of it " * 6  # a long second turn
        await turn(h, conv, eps)
        await turn(h, session(8), eps)  # session 8 takes the one slot: session 7 goes to RAM
    eng0 = eps[0].state.engine
    assert eng0._core.prompt_cache.stats().entries >= 1
    async with router.client() as c:
        await synced(router, eps)
        restored = eng0._core.prompt_cache.restored
        where, body = await turn(c, conv, eps)
    assert where == 0, "the router did not credit engine 0 with the history it holds in RAM"
    assert eng0._core.prompt_cache.restored == restored + 1 and cached(body) > 0
