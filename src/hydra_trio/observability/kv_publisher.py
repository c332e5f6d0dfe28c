"""Publishes what the slots hold as vLLM KV events over ZMQ (wire/kvevents.py), for routers
that route by cache (vllm-router ``--policy kv_aware``), and serves replays of recent batches.

Publishing never waits: the PUB socket drops what a slow subscriber's high-water mark cannot
take (the subscriber sees a gap in ``seq`` and asks the replay socket), and every send is
non-blocking on the trio thread. ``seq`` starts at 0 with the process, so a subscriber reads
a restart as one and drops that engine's blocks.

A new subscription (the XPUB socket hears it: a router started, or reconnected after this
engine restarted) is answered in one of two ways. While the replay ring still holds every
batch since seq 0, with an empty batch: the subscriber learns the current seq, sees that it
lacks the ones before and replays them (as vLLM's consumers do on their first message), and
nobody else is disturbed. Once the ring has dropped its oldest batches (or there is no replay
socket), with a resync (``SlotBlocks.resync``: AllBlocksCleared, then every chain), which every
subscriber sees; at most one per ``--kv-events-resync-interval-s``.

Both sockets bound what they receive (``MAXMSGSIZE``), replays are sent from a cursor a few
batches per turn of the trio loop and are rate-limited per peer, and with
``--kv-events-curve-secret-key-file`` both sockets speak CURVE (docs/scaling-out.md).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio
import zmq
import zmq.auth
import zmq.utils.z85
from prometheus_client import CollectorRegistry, Counter

from ..config import Settings
from ..wire.kvevents import (
    END_SEQ,
    MAX_EVENTS_PER_BATCH,
    Event,
    encode_batch,
    encode_seq,
    parse_replay_request,
)
from .curve_keys import load_curve_keys

log = logging.getLogger(__name__)

# libzmq applies MAXMSGSIZE to the handshake's READY command too, whose metadata holds the
# socket type and an identity of up to 255 bytes: below ~300 bytes legitimate peers are
# refused (an 8-byte limit refuses every DEALER). Anything larger than this is a peer to drop.
MAX_RECEIVED_BYTES = 512
# Replay work per turn of the trio loop: requests taken, and batches sent over all cursors.
_REPLAY_REQUESTS_PER_TURN = 64
_REPLAY_SENDS_PER_TURN = 256
# Replays in progress at once (a request past it is refused), and peers whose request rate
# is remembered (the least recently heard is forgotten first).
_MAX_REPLAYS = 64
_MAX_RATE_PEERS = 1024
# Empty batches that answer subscriptions at most this often: a flood of connects cannot fill
# the ring with them (they are cheap, so this is far shorter than the resync interval).
_HELLO_INTERVAL_S = 0.1
# --kv-events-topic's preset for llm-d: its KV-cache indexer splits the topic on "@" to learn
# which pod sent a batch and for which model (pod ids key its index).
LLMD_TOPIC_PRESET = "llm-d"
LLMD_TOPIC = "kv@{pod}@{model}"
# Room for what {pod} and {model} add to the topic in a subscription (MAXMSGSIZE).
_TOPIC_ROOM = 256
# ZAP (ZeroMQ's authentication protocol, RFC 27): libzmq asks this inproc endpoint of the
# sockets' context whether a CURVE client key may connect.
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class _Ring:
    """Recent batches by seq for replays: ``[oldest, next)`` with no holes, at most
    ``max_batches`` and ``max_bytes`` (the oldest go first). A dict, so that a replay reads
    from any seq on without walking (or copying) what comes before."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self._by_seq: dict[int, bytes] = {}
        self._max_batches = max_batches
        self._max_bytes = max_bytes
        self._bytes = 0
        self.oldest = 0  # stays 0 while every batch since the process started is kept
        self.next = 0

    def append(self, payload: bytes) -> None:
        self._by_seq[self.next] = payload
        self.next += 1
        self._bytes += len(payload)
        while self._by_seq and (len(self._by_seq) > self._max_batches or self._bytes > self._max_bytes):
            self._bytes -= len(self._by_seq.pop(self.oldest))
            self.oldest += 1
        if not self._by_seq:
            self.oldest = self.next

    def get(self, seq: int) -> bytes | None:
        return self._by_seq.get(seq)

    @property
    def complete(self) -> bool:
        """Every batch since seq 0 is still here: a replay from 0 rebuilds everything."""
        return self.oldest == 0


@dataclass(slots=True)
class _Replay:
    """One peer's replay in progress: the batches ``[next, end)`` left to send."""

    next: int
    end: int


class _RateLimit:
    """A token bucket per peer: ``rate`` requests per second, a burst of ``max(1, rate)``."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(1.0, rate)
        self._peers: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # peer -> (tokens, at)

    def allow(self, peer: bytes, now: float) -> bool:
        tokens, at = self._peers.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        allowed = tokens >= 1.0
        self._peers[peer] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._peers) > _MAX_RATE_PEERS:
            self._peers.popitem(last=False)
        return allowed


def pod_name() -> str:
    """What {pod} stands for: $POD_NAME (what an llm-d manifest sets from the downward API,
    and what its indexer is told the pod is called), else the host name (a pod's own)."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def topic_template(settings: Settings) -> str:
    return LLMD_TOPIC if settings.kv_events_topic == LLMD_TOPIC_PRESET else settings.kv_events_topic


def expand_topic(template: str, pod: str, model: str) -> str:
    """The topic with {pod} and {model} filled in (config.validate admits no other name)."""
    return template.format(pod=pod, model=model)


def event_encoding(settings: Settings) -> str:
    """How events are laid out on the wire: auto is "array" for llm-d, else "map"."""
    if settings.kv_events_encoding != "auto":
        return settings.kv_events_encoding
    return "array" if settings.kv_events_topic == LLMD_TOPIC_PRESET else "map"


class KvEventPublisher:
    """The PUB socket, the ring of recent batches and the replay ROUTER socket. Used from the
    trio thread only (zmq sockets are not thread-safe)."""

    def __init__(self, settings: Settings, registry: CollectorRegistry) -> None:
        assert settings.kv_events_endpoint is not None
        self.block_size = settings.kv_events_block_size
        self.encoding = event_encoding(settings)
        self.template = topic_template(settings)
        # {model} is known once the model loads (set_model); until then it reads "".
        self.topic = expand_topic(self.template, pod_name(), "").encode()
        self._curve = load_curve_keys(settings)
        # Its own context: the ZAP endpoint below is one per context.
        self._ctx = zmq.Context()
        self._closed = False
        # At most one batch fewer than a peer's send queue holds, so that a whole replay fits it.
        self._ring = _Ring(max(1, settings.kv_events_hwm - 1), settings.kv_events_replay_bytes)
        self._rate = _RateLimit(settings.kv_events_replay_rate)
        self._resync_interval = settings.kv_events_resync_interval_s
        self._sockets: list[zmq.Socket[bytes]] = []
        self._zap: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if self._curve is not None and self._curve.allowed is not None:
                # Bound before the sockets that use it: a handshake waits for its answer.
                self._zap = self._ctx.socket(zmq.REP)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(_ZAP_ENDPOINT)
                self._sockets.append(self._zap)
            self._pub = self._bind(zmq.XPUB, settings.kv_events_endpoint, "kv_events_endpoint", settings.kv_events_hwm)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first
            if settings.kv_events_replay_endpoint:
                self._replay = self._bind(
                    zmq.ROUTER, settings.kv_events_replay_endpoint, "kv_events_replay_endpoint", settings.kv_events_hwm
                )
                # A full or vanished peer raises (Again / EHOSTUNREACH) instead of silently
                # losing the middle of its replay.
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
        except BaseException:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._events = Counter("hydra_kv_events", "KV events published, by type", ["type"], registry=registry)
        self._batches = Counter("hydra_kv_event_batches", "KV event batches "
                                "published (one seq each)", registry=registry)
        self._replays = Counter("hydra_kv_event_replays", "replay requests answered", registry=registry)
        self._refused = Counter(
            "hydra_kv_event_replays_refused",
            "replay requests not answered: malformed, past --kv-events-replay-rate, or too many replays at once",
            ["reason"],
            registry=registry,
        )
        self._subscriptions = Counter(
            "hydra_kv_event_subscriptions", "subscriptions to the topic heard", registry=registry
        )
        self._resyncs = Counter(
            "hydra_kv_event_resyncs", "times everything held was told anew, for a new subscription", registry=registry
        )
        self._zap_refused = Counter("hydra_kv_event_curve_refused", "CURVE clients refused "
                                    "(key not allowed)", registry=registry)

    def _bind(self, kind: int, endpoint: str, name: str, hwm: int) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        self._sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)  # closing never waits on a subscriber
        sock.setsockopt(zmq.SNDHWM, hwm)
        # What a peer may send: subscriptions (1 + a prefix) and 8-byte replay requests.
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_RECEIVED_BYTES + len(self.template) + _TOPIC_ROOM)
        if self._curve is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.secret)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise SystemExit(f"{name}: cannot bind {endpoint!r}: {exc}") from None
        return sock

    def set_model(self, model: str) -> None:
        """Name the served model in the topic (before the first event is published)."""
        self.topic = expand_topic(self.template, pod_name(), model).encode()

    @property
    def next_seq(self) -> int:
        return self._ring.next

    @property
    def curve_public_key(self) -> str | None:
        return self._curve.public.decode() if self._curve is not None else None

    def publish(self, events: Sequence[Event]) -> None:
        """Send ``events`` in order, as batches of at most the router's event limit."""
        for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
            self._send_batch(events[start : start + MAX_EVENTS_PER_BATCH])

    def _send_batch(self, events: Sequence[Event]) -> None:
        if self._closed:  # the engine's last calls (closing the model) come after the sockets
            return
        payload = encode_batch(time.time(), events, encoding=self.encoding)
        seq = self._ring.next
        self._ring.append(payload)
        try:
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # PUB drops at its high-water mark; this is rarer still
            log.warning("kv events: batch %d not sent (%s); subscribers will ask for a replay", seq, exc)
        self._batches.inc()
        for event in events:
            self._events.labels(event["type"]).inc()

    async def serve(
        self, resync: Callable[[], Awaitable[None]], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Until cancelled: answer replay requests, subscriptions (``resync`` when the ring
        cannot rebuild a subscriber) and, with a CURVE allowlist, ZAP requests."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_subscriptions, resync)
            if self._replay is not None:
                nursery.start_soon(self._serve_replays, self._replay)
            if self._zap is not None:
                nursery.start_soon(_serve_readable, self._zap, self._authenticate)
            task_status.started()

    # ---- subscriptions ----------------------------------------------------------------------

    async def _serve_subscriptions(self, resync: Callable[[], Awaitable[None]]) -> None:
        sock = self._pub
        fd = sock.getsockopt(zmq.FD)
        wanted = False  # a subscription heard and not yet answered
        hello_at = resync_at = -math.inf  # earliest times of the next answers of each kind
        while True:
            # zmq's FD signals edge-style: drain everything readable before waiting again.
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                msg = sock.recv(zmq.NOBLOCK)
                # b"\x01" + prefix: a subscription; one that matches our topic wants our state.
                if msg[:1] == b"\x01" and self.topic.startswith(msg[1:]):
                    wanted = True
                    self._subscriptions.inc()
                await trio.lowlevel.checkpoint()
            due = math.inf  # when the subscriptions waiting are answered
            if wanted:
                now = trio.current_time()
                if self._ring.complete and self._replay is not None:
                    if now >= hello_at:  # one empty batch: "the next seq is this; replay the rest"
                        wanted, hello_at = False, now + _HELLO_INTERVAL_S
                        self._send_batch([])
                    else:
                        due = hello_at
                elif now >= resync_at:
                    wanted, resync_at = False, now + self._resync_interval
                    self._resyncs.inc()
                    await resync()
                    continue  # more may have come meanwhile (and the FD's edge may be gone)
                else:
                    due = resync_at
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                continue
            with trio.move_on_at(due):
                await trio.lowlevel.wait_readable(fd)

    # ---- replays ----------------------------------------------------------------------------

    async def _serve_replays(self, sock: zmq.Socket[bytes]) -> None:
        """Answer replay requests from cursors into the ring: each turn takes a bounded number
        of requests and sends a bounded number of batches over all replays in progress, then
        lets the rest of the engine run."""
        fd = sock.getsockopt(zmq.FD)
        replays: OrderedDict[bytes, _Replay] = OrderedDict()
        while True:
            for _ in range(_REPLAY_REQUESTS_PER_TURN):
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                    break
                self._request(sock.recv_multipart(zmq.NOBLOCK), replays)
            if replays:
                share = max(1, _REPLAY_SENDS_PER_TURN // len(replays))
                for peer in list(replays):
                    self._send_replay(sock, peer, replays, share)
            if replays or sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.wait_readable(fd)

    def _request(self, frames: list[bytes], replays: OrderedDict[bytes, _Replay]) -> None:
        request = parse_replay_request(frames)
        if request is None:
            self._refused.labels("malformed").inc()
            log.debug("kv events: malformed replay request of %d frames ignored", len(frames))
            return
        peer, start = request
        if not self._rate.allow(peer, trio.current_time()):
            self._refused.labels("rate").inc()
            return
        if peer not in replays and len(replays) >= _MAX_REPLAYS:
            self._refused.labels("busy").inc()
            return
        # A peer's new request replaces its replay in progress (it asks for what it wants now).
        replays.pop(peer, None)
        ring = self._ring
        replays[peer] = _Replay(next=max(start, ring.oldest), end=ring.next)
        self._replays.inc()
        log.info(
            "kv events: replay from seq %d: batches %d..%d (ring holds %d..%d)",
            start, max(start, ring.oldest), ring.next - 1, ring.oldest, ring.next - 1,
        )  # fmt: skip

    def _send_replay(self, sock: zmq.Socket[bytes], peer: bytes, replays: OrderedDict[bytes, _Replay], n: int) -> None:
        """Send up to ``n`` more batches of ``peer``'s replay, and its end once all are sent."""
        replay = replays[peer]
        try:
            for _ in range(n):
                payload = self._ring.get(replay.next) if replay.next < replay.end else None
                if payload is None:  # all sent, or the ring dropped the rest meanwhile (a gap it sees)
                    sock.send_multipart([peer, b"", b"", END_SEQ, b""], zmq.NOBLOCK)
                    del replays[peer]
                    return
                sock.send_multipart([peer, b"", self.topic, encode_seq(replay.next), payload], zmq.NOBLOCK)
                replay.next += 1
        except zmq.ZMQError as exc:  # its queue is full, or it left: it sees no end and asks again
            log.debug("kv events: replay to a peer abandoned at seq %d (%s)", replay.next, exc)
            del replays[peer]
            return
        replays.move_to_end(peer)  # the others first next turn

    # ---- CURVE ------------------------------------------------------------------------------

    def _authenticate(self, frames: list[bytes]) -> None:
        """Answer one ZAP request: a CURVE client key is allowed when it is listed."""
        assert self._zap is not None and self._curve is not None and self._curve.allowed is not None
        if len(frames) < 6:  # not a ZAP request: a REP socket must still answer it
            self._zap.send_multipart([b"1.0", b"", b"400", b"malformed", b"", b""])
            return
        version, request_id, _domain, _address, _identity, mechanism, *credentials = frames
        ok = mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] in self._curve.allowed
        if not ok:
            self._zap_refused.inc()
            log.info("kv events: CURVE client refused (its public key is not in --kv-events-curve-allowed-keys-file)")
        status = [b"200", b"OK"] if ok else [b"400", b"key not allowed"]
        self._zap.send_multipart([version, request_id, *status, b"", b""])

    def describe(self) -> dict[str, Any]:
        """For /version: where to subscribe and what the blocks mean."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic.decode(),
            "encoding": self.encoding,
            "block_size": self.block_size,
            "next_seq": self._ring.next,
            "curve_public_key": self.curve_public_key,
        }

    def close(self) -> None:
        self._closed = True
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.destroy(linger=0)  # also any socket opened on it elsewhere (a monitor): term never waits


async def _serve_readable(sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], None]) -> None:
    """Hand every message ``sock`` receives to ``handle``, on the trio thread, until cancelled."""
    fd = sock.getsockopt(zmq.FD)
    while True:
        # zmq's FD signals edge-style: drain everything readable before waiting again.
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
            handle(sock.recv_multipart(zmq.NOBLOCK))
            await trio.lowlevel.checkpoint()
        await trio.lowlevel.wait_readable(fd)


def open_kv_events(settings: Settings, registry: CollectorRegistry) -> KvEventPublisher | None:
    """Bind the KV event sockets (before the model loads: an endpoint in use stops startup at
    once); None when ``--kv-events-endpoint`` is not set."""
    if not settings.kv_events_endpoint:
        return None
    publisher = KvEventPublisher(settings, registry)
    log.info(
        "KV events: publishing on %s (replay %s), %d-token blocks, topic %r, %s events, %s",
        publisher.endpoint,
        publisher.replay_endpoint or "off",
        publisher.block_size,
        publisher.template,
        publisher.encoding,
        f"CURVE on, server public key {publisher.curve_public_key}" if publisher.curve_public_key else "no CURVE",
    )
    return publisher
