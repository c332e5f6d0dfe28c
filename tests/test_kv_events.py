"""KV events (--kv-events-endpoint): what the slots hold, told as vLLM's BlockStored /
BlockRemoved / AllBlocksCleared events over ZMQ, with a replay socket. The events, applied in
order as a router applies them, must give exactly the blocks the slots hold."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from helpers import http, rpc, wait_slots_idle, wait_slots_until
from hydra_trio.config import Settings
from hydra_trio.engine.kvblocks import SlotBlocks, block_hash
from hydra_trio.kvevents import KvEventPublisher, open_kv_events
from hydra_trio.metrics import Metrics
from hydra_trio.wire.kvevents import (
    Event,
    decode_batch,
    decode_seq,
    encode_batch,
    parse_replay_request,
    replay_request,
)

Index = dict[int, tuple[int | None, tuple[int, ...]]]  # block hash -> (parent, its tokens)


def apply(index: Index, events: Sequence[Event]) -> None:
    """What a router's index does with events (and what it needs of them)."""
    for ev in events:
        kind = ev["type"]
        if kind == "BlockStored":
            parent, bs, toks = ev["parent_block_hash"], ev["block_size"], ev["token_ids"]
            assert parent is None or parent in index, "a store whose parent was never stored"
            assert len(toks) == bs * len(ev["block_hashes"]) and ev["medium"] == "GPU"
            for i, h in enumerate(ev["block_hashes"]):
                assert h not in index, "a block stored twice without a removal between"
                index[h] = (parent, tuple(toks[i * bs : (i + 1) * bs]))
                parent = h
        elif kind == "BlockRemoved":
            for h in ev["block_hashes"]:
                del index[h]  # KeyError: removal of a block never stored
        else:
            assert kind == "AllBlocksCleared"
            index.clear()


def expected(slots: Sequence[Sequence[int]], bs: int) -> Index:
    """The blocks that slots holding ``slots`` hold."""
    out: Index = {}
    for tokens in slots:
        parent = None
        for i in range(len(tokens) // bs):
            block = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, block)
            out[h] = (parent, block)
            parent = h
    return out


def replay_sync(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every batch from ``start``, as vllm-router's DEALER does."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(replay_request(start))
        out = []
        while True:
            if not sock.poll(20_000):
                raise TimeoutError("replay socket did not answer")
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if decode_seq(seq) == -1:
                assert topic == b"" and payload == b""
                return out
            out.append((decode_seq(seq), payload))
    finally:
        sock.close()


def events_of(batches: Sequence[tuple[int, bytes]]) -> list[Event]:
    return [ev for _, payload in batches for ev in decode_batch(payload)[1]]


# ---- the block bookkeeping ------------------------------------------------------------------


def test_blocks_are_stored_once_full_and_shared_prefixes_are_one_chain() -> None:
    sb = SlotBlocks(2, 4)
    index: Index = {}
    toks = list(range(10, 30))
    for n in range(1, 11):  # generation: one token at a time
        sb.slot_changed(0, toks[:n], n - 1)
    evs = sb.take()
    assert [e["type"] for e in evs] == ["BlockStored", "BlockStored"]  # at 4 and 8 tokens
    apply(index, evs)
    sb.slot_changed(1, toks[:9], 0)  # another slot with the same 9 tokens: nothing new
    assert sb.take() == []
    sb.slot_changed(1, toks[:13], 9)  # ... then one block more, parented on the shared chain
    (ev,) = sb.take()
    assert ev["parent_block_hash"] == block_hash(block_hash(None, toks[:4]), toks[4:8])
    apply(index, [ev])
    sb.slot_changed(0, [], 0)  # slot 0 dropped: slot 1 still holds its blocks
    assert sb.take() == []
    sb.slot_changed(1, toks[:5], 5)  # cut back: two blocks go, the first stays
    (ev,) = sb.take()
    assert ev["type"] == "BlockRemoved" and len(ev["block_hashes"]) == 2
    apply(index, [ev])
    assert index == expected([toks[:5]], 4)


def test_a_restore_of_what_the_slot_holds_says_nothing_and_a_clear_says_all() -> None:
    sb = SlotBlocks(1, 4)
    toks = list(range(12))
    index: Index = {}
    sb.slot_changed(0, toks, 0)
    apply(index, sb.take())
    sb.slot_changed(0, toks, 0)  # a restore (kept 0) of the same tokens
    assert sb.take() == []
    other = [*toks[:6], 99, 98, 97, 96]
    sb.slot_changed(0, other, 0)  # a restore that differs from block 1 on
    evs = events_of([(0, encode_batch(0.0, sb.take()))])  # through the wire
    assert [e["type"] for e in evs] == ["BlockRemoved", "BlockStored"]
    apply(index, evs)
    assert index == expected([other], 4)
    sb.all_cleared()
    assert sb.take() == [{"type": "AllBlocksCleared"}] and sb.n_held == 0


def test_a_resync_tells_each_chain_once_from_scratch() -> None:
    sb = SlotBlocks(3, 4)
    a, b = list(range(20)), [*range(8), 50, 51, 52, 53, 54]
    for slot, toks in ((0, a), (1, b), (2, a[:9])):
        sb.slot_changed(slot, toks, 0)
    sb.take()
    sb.resync()
    evs = sb.take()
    assert evs[0]["type"] == "AllBlocksCleared" and len(evs) == 3  # b and a[:9] share a's head
    index: Index = {999: (None, (1,))}  # something stale: the resync clears it
    apply(index, evs)
    assert index == expected([a, b], 4)


# ---- the wire and the sockets ---------------------------------------------------------------


def test_batches_and_replay_requests_round_trip() -> None:
    ev = {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(1.5, [ev])) == (1.5, [ev], None)
    assert parse_replay_request([b"peer", *replay_request(7)]) == (b"peer", 7)
    assert parse_replay_request([b"peer", b"x", b"12345678"]) is None


def _publisher(**kw: Any) -> KvEventPublisher:
    settings = Settings(kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0", **kw)
    pub = open_kv_events(settings, Metrics().registry)
    assert pub is not None
    return pub


async def test_publishing_never_waits_for_a_stalled_subscriber_and_the_ring_is_bounded() -> None:
    pub = _publisher(kv_events_hwm=50, kv_events_replay_bytes=20_000)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 4)
    sub.connect(pub.endpoint)
    sub.subscribe(b"")
    try:
        big = [{"type": "BlockRemoved", "block_hashes": list(range(100)), "medium": "GPU"}]
        for _ in range(5000):  # a subscriber that never reads: every call returns at once
            pub.publish(big)
        assert pub.next_seq == 5000
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.serve, trio.lowlevel.checkpoint)
            got = await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, 0)
            nursery.cancel_scope.cancel()
        seqs = [s for s, _ in got]
        assert seqs == list(range(seqs[0], 5000)) and seqs[0] > 0  # the newest, within 20 kB
        assert sum(len(p) for _, p in got) <= 20_000
    finally:
        sub.close()
        pub.close()


def test_an_endpoint_that_cannot_be_bound_stops_startup_with_its_name() -> None:
    with pytest.raises(SystemExit, match="kv_events_endpoint: cannot bind 'nope://x'"):
        open_kv_events(Settings(kv_events_endpoint="nope://x"), Metrics().registry)


# ---- a live engine ----------------------------------------------------------------------------


async def _chat(h: Any, text: str, n: int = 12) -> dict[str, Any]:
    r = await h.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kv_unified", [False, True])
async def test_events_replayed_reproduce_exactly_the_blocks_the_slots_hold(
    start_engine: Callable[..., Any], tiny_model: Path, kv_unified: bool
) -> None:
    ep = await start_engine(
        tiny_model,
        kv_unified=kv_unified,
        slots=3,
        ctx_size=3 * 512,
        cache_ram_mib=64,
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
    )
    eng, pub = ep.state.engine, ep.state.kv_events
    bs = pub.block_size
    index: Index = {}
    applied = 0

    async def check() -> None:
        nonlocal applied
        await wait_slots_idle(eng)
        async with eng.worker.limiter:  # every GPU-worker call queued so far has run ...
            pass
        await trio.testing.wait_all_tasks_blocked()  # ... and its caller published its events
        batches = await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, applied)
        assert [s for s, _ in batches] == list(range(applied, pub.next_seq))
        apply(index, events_of(batches))
        applied = pub.next_seq
        assert index == expected([eng.slot_tokens(s) for s in range(3)], bs)

    async with http(ep) as h:
        topics = ["the river and the mill", "a red kite over the hills", "seven owls", "winter bread", "a lost key"]
        for t in topics:  # five sessions on three slots: evictions, the prompt cache
            await _chat(h, f"tell me about {t}, and why it matters to us all " * 3)
        await check()
        await _chat(h, f"tell me about {topics[0]}, and why it matters to us all " * 3, n=30)  # swapped back in
        await check()
        # A prompt that shares most of a slot's history and then differs: the slot is cut.
        for prompt in ("once upon a time " * 12, "once upon a time " * 9 + "a dragon slept " * 3):
            r = await h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0})
            assert r.status_code == 200
            await check()
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * bs
        # One slot's state into another that holds something else: a shared chain, held twice.
        src, dst, *_ = (s for s in range(3) if eng.n_past(s) >= 2 * bs)
        assert eng.slot_tokens(dst)[:bs] != eng.slot_tokens(src)[:bs] or eng.n_past(dst) != eng.n_past(src)
        state = await h.get(f"/slots/{src}/state")
        assert state.status_code == 200
        put = await h.put(f"/slots/{dst}/state", content=state.content)
        assert put.status_code == 200, put.text
        await check()
        assert any(n == 2 for n in eng.kv_blocks.held().values())
        assert (await h.post(f"/slots/{src}?action=erase")).status_code == 200
        await check()
        assert (await h.post(f"/slots/{dst}?action=erase")).status_code == 200
        await check()
        # T2 empties every slot: AllBlocksCleared, and the events go on from there.
        c = await rpc(ep)
        async with c:
            assert (await c.configure(0, {"n_ctx": 3 * 256})).meta["success"]
        await wait_slots_until(eng, lambda: eng.n_ctx == 3 * 256)
        await check()
        assert index == {}
        await _chat(h, "after the rebuild " * 8)
        await check()
        assert index
        kinds = {e["type"] for e in events_of(await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, 0))}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        assert eng.prompt_cache.restored >= 1  # a history came back from host memory
        version = (await h.get("/version")).json()["kv_events"]
        assert version["endpoint"] == pub.endpoint and version["block_size"] == bs
        metrics = (await h.get("/metrics")).text
        assert "hydra_kv_event_batches_total" in metrics and f"hydra_kv_blocks_held {float(len(index))}" in metrics


async def test_a_subscriber_receives_the_batches_the_ring_keeps(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(
        tiny_model, kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0"
    )
    pub = ep.state.kv_events
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.endpoint)
    sub.subscribe(b"")
    got: list[list[bytes]] = []
    try:
        async with http(ep) as h:
            # A subscription takes effect some time after connect: chat until messages arrive.
            with trio.fail_after(60):
                i = 0
                while not got:
                    await _chat(h, f"message number {i} " * 10)
                    i += 1
                    while sub.poll(0):
                        got.append(sub.recv_multipart())
            await _chat(h, "one more for the road " * 10)
            await wait_slots_idle(ep.state.engine)
        with trio.fail_after(20):
            while decode_seq(got[-1][1]) < pub.next_seq - 1:  # what is still on its way
                if await trio.to_thread.run_sync(sub.poll, 100):
                    got.append(sub.recv_multipart())
        seqs = [decode_seq(f[1]) for f in got]
        assert seqs == list(range(seqs[0], pub.next_seq))  # in order, none lost
        ring = dict(await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, seqs[0]))
        assert all(f[0] == b"" and ring[decode_seq(f[1])] == f[2] for f in got)
    finally:
        sub.close()


async def test_a_late_subscriber_learns_everything_held_from_a_resync(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    """The replay ring keeps one batch only: a subscriber that comes after the chats cannot
    replay them, yet the resync its subscription brings gives it every block held."""
    ep = await start_engine(tiny_model, kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_bytes=1)
    eng, pub = ep.state.engine, ep.state.kv_events
    async with http(ep) as h:
        for t in ("the first long conversation about rivers", "a second one about mills and bread"):
            await _chat(h, t * 4)
    await wait_slots_idle(eng)
    held_before = eng.kv_blocks.n_held
    assert held_before > 0
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.endpoint)
    sub.subscribe(b"")
    try:
        index: Index = {999: (None, (1,))}  # what an earlier incarnation left: cleared
        assert await trio.to_thread.run_sync(sub.poll, 30_000), "no resync came"
        _, seq, payload = sub.recv_multipart()
        assert decode_seq(seq) == pub.next_seq - 1
        apply(index, decode_batch(payload)[1])
        assert index == expected([eng.slot_tokens(s) for s in range(2)], pub.block_size)
        assert len(index) == held_before
    finally:
        sub.close()
