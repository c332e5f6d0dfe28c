"""KV events for llm-d and the Gateway API Inference Extension (issue 42 item 5): the host
prompt cache's blocks as medium "CPU", the ``kv@{pod}@{model}`` topic, vLLM's positional
event layout, and ``vllm:cache_config_info``.

The events are decoded with vLLM's own msgspec structs (vllm/distributed/kv_events.py),
declared again here because vllm itself does not install on these machines: the current
ones (tagged maps) for the "map" encoding's events, and the ``array_like`` ones (vLLM's
examples/online_serving/kv_events_subscriber.py, and the layout llm-d's indexer decodes)
for the "array" encoding's whole batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zmq

from helpers import http
from hydra_trio.config import Settings, validate
from hydra_trio.engine.kv import HostBlocks, PromptCache
from hydra_trio.engine.kv.blocks import block_hash
from hydra_trio.engine.llama import Snapshot
from hydra_trio.observability import event_encoding, expand_topic, pod_name, topic_template
from hydra_trio.wire.kvevents import Event, block_removed, block_stored, decode_batch, encode_batch

msgspec = pytest.importorskip("msgspec")

BS = 4


# ---- vLLM's structs, declared again -----------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's current base: a map tagged with "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's array_like base: ``[tag, *fields]``."""


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(ArrayEventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


def vllm_map_events(payload: bytes) -> list[Any]:
    """The "map" encoding: each event through vLLM's current structs."""
    _ts, raw, _rank = msgpack.unpackb(payload, raw=False)
    return [msgspec.convert(ev, BlockStored | BlockRemoved | AllBlocksCleared) for ev in raw]


def vllm_array_batch(payload: bytes) -> ArrayKVEventBatch:
    return msgspec.msgpack.decode(payload, type=ArrayKVEventBatch)


# ---- the host tier ----------------------------------------------------------------------


def snap(tokens: list[int], salt: str | None = None) -> Snapshot:
    return Snapshot(tokens=tokens, buf=bytearray(len(tokens) * 10), offset=0, has_logits=False, salt=salt)


def chain(tokens: list[int]) -> list[int]:
    out, parent = [], None
    for i in range(len(tokens) // BS):
        parent = block_hash(parent, tokens[i * BS : (i + 1) * BS])
        out.append(parent)
    return out


def test_prompt_cache_entries_are_told_as_cpu_blocks_stored_once_and_removed_with_the_last() -> None:
    told: list[Event] = []
    cache = PromptCache(max_bytes=200)
    host = HostBlocks(BS, told.extend)
    cache.watch(host)
    a = list(range(1, 11))  # 2 full blocks and 2 tokens
    b = [*range(1, 5), 50, 51, 52, 53, 54]  # shares a's first block
    assert cache.put(snap(a))
    assert told == [block_stored(chain(a), None, a[:8], BS, "CPU")]
    told.clear()
    assert cache.put(snap(b))
    # Only b's own block: its parent, a's first, is held already.
    assert told == [block_stored(chain(b)[1:], chain(a)[0], b[4:8], BS, "CPU")]
    assert host.held() == {chain(a)[0]: 2, chain(a)[1]: 1, chain(b)[1]: 1}
    told.clear()
    # A resync tells each chain once, the shared block with the first.
    assert host.resync_events() == [
        block_stored(chain(a), None, a[:8], BS, "CPU"),
        block_stored(chain(b)[1:], chain(a)[0], b[4:8], BS, "CPU"),
    ]
    # a goes for room (200 bytes hold a and b, not c too): its own block is removed, the shared one stays.
    c = [9, 9, 9, 9, 8]
    assert cache.put(snap(c))
    assert told[0] == block_removed([chain(a)[1]], "CPU")
    assert told[1] == block_stored(chain(c), None, c[:4], BS, "CPU")
    told.clear()
    # b taken back into a slot: no longer in RAM (the slot then tells it as GPU).
    hit = cache.best(b)
    assert hit is not None
    cache.take(hit.key)
    assert told == [block_removed([chain(b)[1], chain(a)[0]], "CPU")]
    told.clear()
    cache.clear()
    assert told == [block_removed(chain(c), "CPU")] and host.n_held == 0


def test_a_salted_entry_is_its_own_chain() -> None:
    told: list[Event] = []
    cache = PromptCache(max_bytes=1 << 20)
    cache.watch(HostBlocks(BS, told.extend))
    tokens = list(range(1, 9))
    cache.put(snap(tokens))
    cache.put(snap(tokens, salt="tenant-a"))
    assert len(told) == 2 and told[0]["block_hashes"] != told[1]["block_hashes"]
    assert told[1]["parent_block_hash"] is None  # a chain's first block, salted or not


# ---- the wire, through vLLM's structs ---------------------------------------------------


EVENTS = [
    block_stored([11, 12], None, list(range(8)), BS, "GPU"),
    block_stored([13], 12, [7, 7, 7, 7], BS, "CPU"),
    block_removed([13], "CPU"),
    {"type": "AllBlocksCleared"},
]


def test_map_events_decode_with_vllms_current_structs() -> None:
    payload = encode_batch(1.5, EVENTS)
    got = vllm_map_events(payload)
    assert [type(e).__name__ for e in got] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert got[1].medium == "CPU" and got[1].parent_block_hash == 12 and got[1].token_ids == [7, 7, 7, 7]
    assert got[0].parent_block_hash is None and got[0].block_hashes == [11, 12]


def test_array_batches_decode_with_vllms_array_like_structs_as_llm_d_reads_them() -> None:
    payload = encode_batch(2.5, EVENTS, encoding="array")
    batch = vllm_array_batch(payload)
    assert batch.ts == 2.5
    stored, host, removed, cleared = batch.events
    assert isinstance(stored, ArrayBlockStored) and stored.token_ids == list(range(8)) and stored.medium == "GPU"
    assert isinstance(host, ArrayBlockStored) and host.medium == "CPU" and host.parent_block_hash == 12
    assert isinstance(removed, ArrayBlockRemoved) and removed.medium == "CPU"
    assert isinstance(cleared, ArrayAllBlocksCleared)
    # The raw layout llm-d's Go decoder indexes: [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name].
    raw = msgpack.unpackb(payload, raw=False)[1]
    assert raw[1] == ["BlockStored", [13], 12, [7, 7, 7, 7], BS, None, "CPU", None]
    assert raw[2] == ["BlockRemoved", [13], "CPU"] and raw[3] == ["AllBlocksCleared"]
    # Our own reader takes both layouts.
    assert decode_batch(payload)[1] == EVENTS


# ---- the topic ----------------------------------------------------------------------------


def test_the_llm_d_preset_and_placeholders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "decode-7f9c")
    s = Settings(kv_events_topic="llm-d")
    assert topic_template(s) == "kv@{pod}@{model}" and event_encoding(s) == "array"
    assert expand_topic(topic_template(s), pod_name(), "tiny") == "kv@decode-7f9c@tiny"
    assert event_encoding(Settings(kv_events_topic="llm-d", kv_events_encoding="map")) == "map"
    assert event_encoding(Settings(kv_events_topic="kv@{pod}@{model}")) == "map"
    validate(Settings(kv_events_topic="hydra/{model}/{pod}"))
    for bad, word in (("kv@{host}", "host"), ("kv@{pod", "brace"), ("kv@{}", "pod")):
        with pytest.raises(SystemExit, match=word):
            validate(Settings(kv_events_topic=bad))


async def test_an_engine_publishes_on_its_pod_and_model_topic_cpu_blocks_included(
    start_engine: Callable[..., Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What llm-d's indexer sees: a SUB on ``kv@`` gets [topic, seq, payload] with the pod and
    model in the topic; the payload decodes with vLLM's array_like structs; a history moved to
    RAM arrives as medium CPU. And /metrics has vllm:cache_config_info."""
    monkeypatch.setenv("POD_NAME", "pod-a")
    ep = await start_engine(
        tiny_model,
        slots=1,
        ctx_size=512,
        cache_ram_mib=16,
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_topic="llm-d",
    )
    pub = ep.state.kv_events
    assert pub.topic == f"kv@pod-a@{ep.state.engine.served_name}".encode()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(pub.endpoint)
    got: list[tuple[bytes, Any]] = []

    def drain() -> None:
        while sub.poll(200):
            topic, _seq, payload = sub.recv_multipart()
            got.append((topic, vllm_array_batch(payload)))

    try:
        # The subscription is heard (an empty batch answers it) before anything matters.
        with trio.fail_after(20):
            while not got:
                await trio.to_thread.run_sync(drain)
        async with http(ep) as h:
            # one slot: the first goes to RAM
            for text in ("the river and the mill " * 6, "a red kite over the hills " * 6):
                r = await h.post("/v1/completions", json={"prompt": text, "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
            with trio.fail_after(20):
                while not any(getattr(e, "medium", None) == "CPU" for _, b in got for e in b.events):
                    await trio.to_thread.run_sync(drain)
            metrics = (await h.get("/metrics")).text
    finally:
        sub.close()
    assert {t for t, _ in got} == {pub.topic}
    cpu = [e for _, b in got for e in b.events if isinstance(e, ArrayBlockStored) and e.medium == "CPU"]
    assert cpu and all(len(e.token_ids) == 16 * len(e.block_hashes) for e in cpu)
    gpu = [e for _, b in got for e in b.events if isinstance(e, ArrayBlockStored) and e.medium == "GPU"]
    assert gpu and gpu[0].parent_block_hash is None
    line = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in line and f'num_gpu_blocks="{512 // 16}"' in line and line.endswith(" 1.0")
