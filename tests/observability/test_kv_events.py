"""KV events (--kv-events-endpoint): what the slots hold, told as vLLM's BlockStored /
BlockRemoved / AllBlocksCleared events over ZMQ, with a replay socket. The events, applied in
order as a router applies them, must give exactly the blocks the slots hold."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from helpers import http, rpc, wait_slots_idle, wait_slots_until, wait_until
from hydra_trio.config import Settings, validate
from hydra_trio.engine.kv import SlotBlocks
from hydra_trio.engine.kv.blocks import block_hash
from hydra_trio.observability import KvEventPublisher, Metrics, open_kv_events
from hydra_trio.wire.kvevents import (
    Event,
    decode_batch,
    decode_seq,
    encode_batch,
    parse_replay_request,
    replay_request,
)

Index = dict[int, tuple[int | None, tuple[int, ...]]]  # block hash -> (parent, its tokens)


def apply(index: Index, events: Sequence[Event], medium: str = "GPU") -> None:
    """What a router's index of one medium does with events (and what it needs of them):
    "GPU" the slots, "CPU" the host prompt cache."""
    for ev in events:
        kind = ev["type"]
        if kind != "AllBlocksCleared" and ev["medium"] != medium:
            assert ev["medium"] in ("GPU", "CPU")
            continue
        if kind == "BlockStored":
            parent, bs, toks = ev["parent_block_hash"], ev["block_size"], ev["token_ids"]
            assert parent is None or parent in index, "a store whose parent was never stored"
            assert len(toks) == bs * len(ev["block_hashes"])
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
    registry = Metrics().registry
    pub = open_kv_events(settings, registry)
    assert pub is not None
    pub.test_registry = registry  # type: ignore[attr-defined]  # for _count
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
    host: Index = {}  # the prompt cache's blocks (medium CPU)
    applied = 0

    async def check() -> None:
        nonlocal applied
        await wait_slots_idle(eng)
        async with eng._core.worker.limiter:  # every GPU-worker call queued so far has run ...
            pass
        await trio.testing.wait_all_tasks_blocked()  # ... and its caller published its events
        batches = await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, applied)
        assert [s for s, _ in batches] == list(range(applied, pub.next_seq))
        apply(index, events_of(batches))
        apply(host, events_of(batches), "CPU")
        applied = pub.next_seq
        assert index == expected([eng._core.slot_tokens(s) for s in range(3)], bs)
        assert host == expected([snap.tokens for _, snap in eng._core.prompt_cache.items()], bs)

    async with http(ep) as h:
        topics = ["the river and the mill", "a red kite over the hills", "seven owls", "winter bread", "a lost key"]
        for t in topics:  # five sessions on three slots: evictions, the prompt cache
            await _chat(h, f"tell me about {t}, and why it matters to us all " * 3)
        await check()
        assert host, "the histories moved to RAM are told as medium CPU blocks"
        await _chat(h, f"tell me about {topics[0]}, and why it matters to us all " * 3, n=30)  # swapped back in
        await check()
        # A prompt that shares most of a slot's history and then differs: the slot is cut.
        for prompt in ("once upon a time " * 12, "once upon a time " * 9 + "a dragon slept " * 3):
            r = await h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0})
            assert r.status_code == 200
            await check()
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * bs
        # One slot's state into another that holds something else: a shared chain, held twice.
        src, dst, *_ = (s for s in range(3) if eng._core.n_past(s) >= 2 * bs)
        assert eng._core.slot_tokens(dst)[:bs] != eng._core.slot_tokens(src)[:bs] or eng._core.n_past(
            dst
        ) != eng._core.n_past(src)
        state = await h.get(f"/slots/{src}/state")
        assert state.status_code == 200
        put = await h.put(f"/slots/{dst}/state", content=state.content)
        assert put.status_code == 200, put.text
        await check()
        assert any(n == 2 for n in eng._readout.kv_blocks.held().values())
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
        assert index == {} and host == {}
        await _chat(h, "after the rebuild " * 8)
        await check()
        assert index
        kinds = {e["type"] for e in events_of(await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, 0))}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        assert eng._core.prompt_cache.restored >= 1  # a history came back from host memory
        version = (await h.get("/version")).json()["kv_events"]
        assert version["endpoint"] == pub.endpoint and version["block_size"] == bs
        metrics = (await h.get("/metrics")).text
        assert "hydra_kv_event_batches_total" in metrics and f"hydra_kv_blocks_held {float(len(index))}" in metrics


async def test_a_subscriber_receives_the_batches_the_ring_keeps(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
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
    held_before = eng._readout.kv_blocks.n_held
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
        assert index == expected([eng._core.slot_tokens(s) for s in range(2)], pub.block_size)
        assert len(index) == held_before
    finally:
        sub.close()


# ---- hardening: message size, replays, subscriptions, CURVE ----------------------------------


def _count(pub: KvEventPublisher, name: str, **labels: str) -> float:
    return pub.test_registry.get_sample_value(name, labels) or 0.0  # type: ignore[attr-defined]


def _monitor_events(mon: zmq.Socket[bytes], want: int, timeout_ms: int = 10_000) -> list[int]:
    """Events of a socket monitor until ``want`` is seen (or the deadline)."""
    from zmq.utils.monitor import recv_monitor_message

    seen: list[int] = []
    while want not in seen:
        if not mon.poll(timeout_ms):
            break
        seen.append(recv_monitor_message(mon)["event"])
    return seen


def _socket(kind: int, endpoint: str, **opts: Any) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 5000)  # a send never blocks the test's trio thread for ever
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


async def _resync_recorder(pub: KvEventPublisher) -> tuple[list[float], Callable[[], Any]]:
    calls: list[float] = []

    async def resync() -> None:
        calls.append(trio.current_time())
        pub.publish([{"type": "AllBlocksCleared"}])

    return calls, resync


async def test_a_peer_that_sends_an_oversized_message_is_dropped_before_it_is_read() -> None:
    pub = _publisher()
    replay_mon = pub._replay.get_monitor_socket()  # type: ignore[union-attr]
    pub_mon = pub._pub.get_monitor_socket()
    big = _socket(zmq.DEALER, pub.replay_endpoint)  # type: ignore[arg-type]
    fat_sub = _socket(zmq.SUB, pub.endpoint)
    try:
        _, resync = await _resync_recorder(pub)
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.serve, resync)
            big.send_multipart([b"", b"x" * 1_000_000])  # a "replay request" of 1 MB
            seen = await trio.to_thread.run_sync(_monitor_events, replay_mon, zmq.EVENT_DISCONNECTED)
            assert zmq.EVENT_DISCONNECTED in seen, seen
            fat_sub.subscribe(b"y" * 100_000)  # a subscription of 100 kB
            seen = await trio.to_thread.run_sync(_monitor_events, pub_mon, zmq.EVENT_DISCONNECTED)
            assert zmq.EVENT_DISCONNECTED in seen, seen
            # Ordinary peers are unaffected, and the big messages never reached the engine.
            assert await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, 0) == []
            nursery.cancel_scope.cancel()
        assert _count(pub, "hydra_kv_event_replays_refused_total", reason="malformed") == 0
        assert _count(pub, "hydra_kv_event_subscriptions_total") == 0
    finally:
        for sock in (big, fat_sub, replay_mon, pub_mon):
            sock.close(linger=0)
        pub.close()


async def test_a_replay_is_sent_from_its_cursor_a_bounded_share_per_turn() -> None:
    """A replay of thousands of batches never holds the trio thread: between two runs of
    another task, at most two turns' shares (256 batches each, and the end) are sent (trio runs
    the tasks of a batch in random order: one turn before the other task, one after)."""
    pub = _publisher()
    for i in range(3000):
        pub.publish([{"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU"}])
    sock = pub._replay
    assert sock is not None
    sent = 0
    real_send = sock.send_multipart

    def counting_send(frames: Any, flags: int = 0) -> Any:
        nonlocal sent
        sent += 1
        return real_send(frames, flags)

    sock.send_multipart = counting_send  # type: ignore[method-assign]
    most = 0
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.serve, trio.lowlevel.checkpoint)

            async def watch() -> None:
                nonlocal most
                last = sent
                while True:
                    await trio.lowlevel.checkpoint()
                    most, last = max(most, sent - last), sent

            nursery.start_soon(watch)
            got = await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, 1000)
            nursery.cancel_scope.cancel()
        assert [s for s, _ in got] == list(range(1000, 3000))  # from the cursor on, all of it
        assert sent == 2001 and 0 < most <= 2 * 257, most  # the old code: all 2001 at once
    finally:
        pub.close()


async def test_replay_requests_are_rate_limited_per_peer() -> None:
    pub = _publisher(kv_events_replay_rate=0.01)  # a burst of 1, then one per 100 s
    pub.publish([{"type": "AllBlocksCleared"}])
    flood = _socket(zmq.DEALER, pub.replay_endpoint)  # type: ignore[arg-type]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.serve, trio.lowlevel.checkpoint)
            for _ in range(50):
                flood.send_multipart(replay_request(0))
            await wait_until(lambda: _count(pub, "hydra_kv_event_replays_refused_total", reason="rate") == 49)
            assert _count(pub, "hydra_kv_event_replays_total") == 1
            # Another peer is answered; the flooder got one replay (a batch and the end).
            assert [s for s, _ in await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, 0)] == [0]
            frames = [flood.recv_multipart(zmq.NOBLOCK) for _ in range(2)]
            assert [decode_seq(f[2]) for f in frames] == [0, -1] and not flood.poll(50)
            nursery.cancel_scope.cancel()
    finally:
        flood.close(linger=0)
        pub.close()


async def test_while_the_ring_reaches_seq_0_a_new_subscriber_replays_and_nobody_is_cleared() -> None:
    pub = _publisher()
    for i in range(5):
        pub.publish(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [i],
                    "parent_block_hash": None,
                    "token_ids": [i],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            ]
        )
    calls, resync = await _resync_recorder(pub)
    first = _socket(zmq.SUB, pub.endpoint)
    second = _socket(zmq.SUB, pub.endpoint)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.serve, resync)
            first.subscribe(b"")
            assert await trio.to_thread.run_sync(first.poll, 10_000), "no answer to a subscription"
            _, seq, payload = first.recv_multipart()
            assert decode_seq(seq) == 5 and decode_batch(payload)[1] == []  # "seq 5 is next; replay the rest"
            second.subscribe(b"")
            assert await trio.to_thread.run_sync(first.poll, 10_000)
            _, seq, payload = first.recv_multipart()
            assert decode_seq(seq) == 6 and decode_batch(payload)[1] == []  # what the first one sees
            _, seq, _ = second.recv_multipart()
            assert decode_seq(seq) == 6
            replayed = await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, 0)
            nursery.cancel_scope.cancel()
        assert calls == []  # no resync, so no AllBlocksCleared for anybody
        index: Index = {}
        apply(index, events_of(replayed))
        assert sorted(index) == list(range(5))
    finally:
        first.close()
        second.close()
        pub.close()


async def test_once_the_ring_lost_seq_0_subscriptions_bring_resyncs_at_most_one_per_interval() -> None:
    pub = _publisher(kv_events_replay_bytes=1, kv_events_resync_interval_s=1.0)
    pub.publish([{"type": "AllBlocksCleared"}])  # dropped from the ring at once
    calls, resync = await _resync_recorder(pub)
    subs: list[zmq.Socket[bytes]] = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.serve, resync)
            for n in range(1, 6):  # five subscriptions, each heard before the next
                subs.append(_socket(zmq.SUB, pub.endpoint))
                subs[-1].subscribe(b"")
                await wait_until(lambda n=n: _count(pub, "hydra_kv_event_subscriptions_total") == n)
            assert len(calls) == 1  # the first at once; the other four wait ...
            await wait_until(lambda: len(calls) == 2, 10.0)  # ... and share the next one
            assert calls[1] - calls[0] >= 1.0
            await trio.sleep(1.2)
            assert len(calls) == 2  # nothing more was asked
            nursery.cancel_scope.cancel()
        assert _count(pub, "hydra_kv_event_resyncs_total") == 2
    finally:
        for sub in subs:
            sub.close()
        pub.close()


def _curve_files(tmp_path: Path) -> tuple[Path, Path, bytes, tuple[bytes, bytes], tuple[bytes, bytes]]:
    server_public, server_secret = zmq.curve_keypair()
    allowed, stranger = zmq.curve_keypair(), zmq.curve_keypair()
    secret_file = tmp_path / "server.key"
    secret_file.write_bytes(server_secret + b"\n")
    allowed_file = tmp_path / "clients"
    allowed_file.write_bytes(b"# the router\n" + allowed[0] + b"\n")
    return secret_file, allowed_file, server_public, allowed, stranger


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")
async def test_with_curve_only_an_allowed_client_gets_events_and_replays(tmp_path: Path) -> None:
    secret_file, allowed_file, server_public, (a_pub, a_sec), (s_pub, s_sec) = _curve_files(tmp_path)
    pub = _publisher(
        kv_events_curve_secret_key_file=str(secret_file), kv_events_curve_allowed_keys_file=str(allowed_file)
    )
    assert pub.describe()["curve_public_key"] == server_public.decode()

    def curve(public: bytes, secret: bytes) -> dict[str, Any]:
        return {"CURVE_SERVERKEY": server_public, "CURVE_PUBLICKEY": public, "CURVE_SECRETKEY": secret}

    plain = _socket(zmq.SUB, pub.endpoint)
    stranger = _socket(zmq.SUB, pub.endpoint, **curve(s_pub, s_sec))
    friend = _socket(zmq.SUB, pub.endpoint, **curve(a_pub, a_sec))
    stranger_replay = _socket(zmq.DEALER, pub.replay_endpoint, **curve(s_pub, s_sec))  # type: ignore[arg-type]
    friend_replay = _socket(zmq.DEALER, pub.replay_endpoint, **curve(a_pub, a_sec))  # type: ignore[arg-type]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(pub.serve, trio.lowlevel.checkpoint)
            for sub in (plain, stranger, friend):
                sub.subscribe(b"")
            assert await trio.to_thread.run_sync(friend.poll, 10_000), "the allowed client got nothing"
            friend.recv_multipart()  # the answer to its subscription
            await wait_until(lambda: _count(pub, "hydra_kv_event_curve_refused_total") >= 1)
            pub.publish([{"type": "AllBlocksCleared"}])
            assert await trio.to_thread.run_sync(friend.poll, 10_000)
            _, _, payload = friend.recv_multipart()
            assert decode_batch(payload)[1] == [{"type": "AllBlocksCleared"}]
            assert not plain.poll(300) and not stranger.poll(0)  # neither ever got a byte
            assert _count(pub, "hydra_kv_event_subscriptions_total") == 1

            with contextlib.suppress(zmq.Again):  # refused, it may have no connection to queue on
                stranger_replay.send_multipart(replay_request(0), zmq.NOBLOCK)
            friend_replay.send_multipart(replay_request(0))
            assert await trio.to_thread.run_sync(friend_replay.poll, 10_000)
            frames = [friend_replay.recv_multipart()]
            while decode_seq(frames[-1][2]) != -1:
                assert await trio.to_thread.run_sync(friend_replay.poll, 10_000)
                frames.append(friend_replay.recv_multipart())
            assert [decode_seq(f[2]) for f in frames] == [0, 1, -1]
            assert not stranger_replay.poll(300)
            nursery.cancel_scope.cancel()
    finally:
        for sock in (plain, stranger, friend, stranger_replay, friend_replay):
            sock.close(linger=0)
        pub.close()


def test_curve_settings_that_cannot_work_stop_startup_with_their_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_file, allowed_file, *_ = _curve_files(tmp_path)
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    for kw, match in (
        ({"kv_events_curve_secret_key_file": str(bad)}, r"kv_events_curve_secret_key_file: .* line 1 is not a Z85"),
        ({"kv_events_curve_secret_key_file": str(tmp_path / "missing")},
         "kv_events_curve_secret_key_file: cannot read"),
        (
            {"kv_events_curve_secret_key_file": str(secret_file), "kv_events_curve_allowed_keys_file": str(bad)},
            r"kv_events_curve_allowed_keys_file: .* line 1 is not a Z85",
        ),
    ):
        with pytest.raises(SystemExit, match=match):
            _publisher(**kw)
    with pytest.raises(SystemExit, match="kv_events_curve_allowed_keys_file needs kv_events_curve_secret_key_file"):
        validate(Settings(kv_events_endpoint="tcp://127.0.0.1:0", kv_events_curve_allowed_keys_file=str(allowed_file)))
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(SystemExit, match=r"kv_events_curve_secret_key_file: this libzmq .* without CURVE"):
        _publisher(kv_events_curve_secret_key_file=str(secret_file))


def test_the_help_and_the_docs_suggest_loopback_or_a_private_network_not_every_interface() -> None:
    import argparse

    from hydra_trio.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (action,) = [a for a in parser._actions if "--kv-events-endpoint" in a.option_strings]
    assert action.help is not None
    assert "0.0.0.0" not in action.help and "tcp://127.0.0.1:5557" in action.help and "token ids" in action.help
    docs = Path(__file__).resolve().parents[2] / "docs"
    for page in ("scaling-out.md", "operations.md"):
        text = (docs / page).read_text(encoding="utf-8")
        assert "e.g. `tcp://0.0.0.0" not in text and "tcp://0.0.0.0:557" not in text, page
        assert "loopback" in text and "private network" in text and "--kv-events-curve-secret-key-file" in text, page


async def test_a_sessions_stores_name_it_and_the_disk_tier_is_medium_disk(
    start_engine: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    """Issue 52: a turn's BlockStored names its agent session (map encoding), and what RAM
    drops to the disk tier (--cache-disk) is told as medium DISK, removed when read back."""
    ep = await start_engine(
        tiny_model, slots=1, cache_ram_mib=1, cache_disk=str(tmp_path / "kv"),
        kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0",
    )
    eng, pub = ep.state.engine, ep.state.kv_events
    prompts = [f"session {i} works on its own long task about topic {i} " * 40 for i in range(6)]
    async with http(ep) as h:
        for i, p in enumerate(prompts):
            r = await h.post("/v1/completions", json={"prompt": p, "max_tokens": 1}, headers={"x-session-id": f"s{i}"})
            assert r.status_code == 200
        await wait_until(lambda: len(eng._core.tiers.disk) >= 1, 30)
        await wait_slots_idle(eng)
        await trio.testing.wait_all_tasks_blocked()
    events = events_of(await trio.to_thread.run_sync(replay_sync, pub.replay_endpoint, 0))
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert {e.get("session_id") for e in stored if e["medium"] == "GPU"} >= {f"s{i}" for i in range(6)}
    disk = [e for e in stored if e["medium"] == "DISK"]
    assert disk and all(e.get("session_id") in {f"s{i}" for i in range(6)} for e in disk)
