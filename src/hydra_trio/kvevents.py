"""Publishes what the slots hold as vLLM KV events over ZMQ (wire/kvevents.py), for routers
that route by cache (vllm-router ``--policy kv_aware``), and serves replays of recent batches.

Publishing never waits: the PUB socket drops what a slow subscriber's high-water mark cannot
take (the subscriber sees a gap in ``seq`` and asks the replay socket), and every send is
non-blocking on the trio thread. ``seq`` starts at 0 with the process, so a subscriber reads
a restart as one and drops that engine's blocks.

Each time a subscriber subscribes (an XPUB socket hears it: a router started, or
reconnected after this engine restarted), the engine tells everything it holds from scratch
(``SlotBlocks.resync``): a late subscriber then holds the slots' exact blocks even when the
replay ring no longer reaches back to seq 0.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
import zmq
from prometheus_client import CollectorRegistry, Counter

from .config import Settings
from .wire.kvevents import (
    END_SEQ,
    MAX_EVENTS_PER_BATCH,
    Event,
    encode_batch,
    encode_seq,
    parse_replay_request,
)

log = logging.getLogger(__name__)


class KvEventPublisher:
    """The PUB socket, the ring of recent batches and the replay ROUTER socket. Used from the
    trio thread only (zmq sockets are not thread-safe)."""

    def __init__(self, settings: Settings, registry: CollectorRegistry) -> None:
        assert settings.kv_events_endpoint is not None
        self.block_size = settings.kv_events_block_size
        self.topic = settings.kv_events_topic.encode()
        self._ctx = zmq.Context.instance()
        self._seq = 0
        self._closed = False
        # Recent batches for replays, at most ``_ring_cap`` payload bytes and one batch fewer
        # than a peer's send queue holds (so that a whole replay fits it); the oldest go first.
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=max(1, settings.kv_events_hwm - 1))
        self._ring_bytes = 0
        self._ring_cap = settings.kv_events_replay_bytes
        self._pub = self._bind(zmq.XPUB, settings.kv_events_endpoint, "kv_events_endpoint", settings.kv_events_hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if settings.kv_events_replay_endpoint:
                self._replay = self._bind(
                    zmq.ROUTER, settings.kv_events_replay_endpoint, "kv_events_replay_endpoint", settings.kv_events_hwm
                )
        except BaseException:
            self._pub.close(linger=0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._events = Counter("hydra_kv_events", "KV events published, by type", ["type"], registry=registry)
        self._batches = Counter("hydra_kv_event_batches", "KV event batches published (one seq each)", registry=registry)
        self._replays = Counter("hydra_kv_event_replays", "replay requests answered", registry=registry)
        self._resyncs = Counter(
            "hydra_kv_event_resyncs", "times everything held was told anew, for a new subscription", registry=registry
        )

    def _bind(self, kind: int, endpoint: str, name: str, hwm: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)  # closing never waits on a subscriber
        sock.setsockopt(zmq.SNDHWM, hwm)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise SystemExit(f"{name}: cannot bind {endpoint!r}: {exc}") from None
        return sock

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[Event]) -> None:
        """Send ``events`` in order, as batches of at most the router's event limit."""
        if self._closed:  # the engine's last calls (closing the model) come after the sockets
            return
        for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
            part = events[start : start + MAX_EVENTS_PER_BATCH]
            payload = encode_batch(time.time(), part)
            seq = encode_seq(self._seq)
            self._keep(self._seq, payload)
            self._seq += 1
            try:
                self._pub.send_multipart([self.topic, seq, payload], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # PUB drops at its high-water mark; this is rarer still
                log.warning("kv events: batch %d not sent (%s); subscribers will ask for a replay", self._seq - 1, exc)
            self._batches.inc()
            for event in part:
                self._events.labels(event["type"]).inc()

    def _keep(self, seq: int, payload: bytes) -> None:
        if len(self._ring) == self._ring.maxlen:
            self._ring_bytes -= len(self._ring[0][1])
        self._ring.append((seq, payload))
        self._ring_bytes += len(payload)
        while self._ring and self._ring_bytes > self._ring_cap:
            self._ring_bytes -= len(self._ring.popleft()[1])

    async def serve(
        self, resync: Callable[[], Awaitable[None]], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Until cancelled: answer replay requests, and ``resync`` for new subscriptions."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_subscriptions, resync)
            if self._replay is not None:
                nursery.start_soon(_serve_readable, self._replay, self._answer)
            task_status.started()

    async def _serve_subscriptions(self, resync: Callable[[], Awaitable[None]]) -> None:
        wanted = False

        def heard(frames: list[bytes]) -> None:
            nonlocal wanted
            # b"\x01" + prefix: a subscription; one that matches our topic wants our state.
            msg = frames[0] if frames else b""
            if msg[:1] == b"\x01" and self.topic.startswith(msg[1:]):
                wanted = True

        async def after_drain() -> None:
            nonlocal wanted
            if wanted:  # one resync for all the subscriptions heard so far
                wanted = False
                self._resyncs.inc()
                await resync()

        await _serve_readable(self._pub, heard, after_drain)

    def _answer(self, frames: list[bytes]) -> None:
        sock = self._replay
        assert sock is not None
        request = parse_replay_request(frames)
        if request is None:
            log.debug("kv events: malformed replay request of %d frames ignored", len(frames))
            return
        peer, start = request
        sent = 0
        try:
            for seq, payload in self._ring:
                if seq >= start:
                    sock.send_multipart([peer, b"", self.topic, encode_seq(seq), payload], zmq.NOBLOCK)
                    sent += 1
            sock.send_multipart([peer, b"", b"", END_SEQ, b""], zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full: it sees an incomplete replay and resyncs
            pass
        self._replays.inc()
        oldest = self._ring[0][0] if self._ring else self._seq
        log.info("kv events: replay from seq %d: %d batches sent (ring holds %d..%d)", start, sent, oldest, self._seq - 1)

    def describe(self) -> dict[str, Any]:
        """For /version: where to subscribe and what the blocks mean."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic.decode(),
            "block_size": self.block_size,
            "next_seq": self._seq,
        }

    def close(self) -> None:
        self._closed = True
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


async def _serve_readable(
    sock: zmq.Socket[bytes],
    handle: Callable[[list[bytes]], None],
    after_drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Hand every message ``sock`` receives to ``handle``, on the trio thread, until cancelled."""
    fd = sock.getsockopt(zmq.FD)
    while True:
        # zmq's FD signals edge-style: drain everything readable before waiting again.
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
            handle(sock.recv_multipart(zmq.NOBLOCK))
            await trio.lowlevel.checkpoint()
        if after_drain is not None:
            await after_drain()
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                continue  # more came meanwhile (and the FD's edge may be gone)
        await trio.lowlevel.wait_readable(fd)


def open_kv_events(settings: Settings, registry: CollectorRegistry) -> KvEventPublisher | None:
    """Bind the KV event sockets (before the model loads: an endpoint in use stops startup at
    once); None when ``--kv-events-endpoint`` is not set."""
    if not settings.kv_events_endpoint:
        return None
    publisher = KvEventPublisher(settings, registry)
    log.info(
        "KV events: publishing on %s (replay %s), %d-token blocks, topic %r",
        publisher.endpoint,
        publisher.replay_endpoint or "off",
        publisher.block_size,
        settings.kv_events_topic,
    )
    return publisher
