"""vLLM's KV cache events on the wire, as vllm-router's ``kv_aware`` policy decodes them.

A publisher sends ZMQ multipart messages ``[topic, seq, payload]``: ``seq`` an 8-byte
big-endian counter that starts at 0 and only rises, ``payload`` the msgpack array
``[ts, events, dp_rank]``. Each event is a map tagged with ``"type"`` (a positional event,
vLLM's older encoding, is refused by the router):

- ``BlockStored``: one chain of full blocks, ``block_hashes[i]``'s parent being
  ``block_hashes[i-1]`` and the first one's ``parent_block_hash`` (nil: the chain starts
  at position 0); ``token_ids`` holds ``block_size`` tokens per block.
- ``BlockRemoved``: ``block_hashes`` no longer held.
- ``AllBlocksCleared``: nothing is held any more.

The replay socket (ZMQ ROUTER) answers ``[empty, start_seq]`` with ``[empty, topic, seq,
payload]`` for each kept batch from ``start_seq`` on, then ``[empty, b"", END_SEQ, b""]``.
Pure: importable without llama_cpp or zmq (docs/protocol-extensions.md §7).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack

from .hashing import xxh3_64

# Where a chain's blocks live, in the router's terms: "GPU" is the device tier (the slots),
# "CPU" the host tier (the prompt cache in RAM, vLLM's name for its CPU offload tier).
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"  # ours: the disk tier (--cache-disk), as vLLM's KV connectors name a disk tier
# How events are laid out (--kv-events-encoding): "map" (tagged maps, what vllm-router
# decodes) or "array" (vLLM's msgspec ``array_like`` structs: each event a positional array
# led by its tag, what llm-d's KV-cache indexer decodes).
ENCODINGS = ("map", "array")
# Each event type's fields in vLLM's struct order (the positional layout of "array").
_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
# Fields an event may leave out (vLLM's defaults: its array layout drops them at the end).
_OPTIONAL = frozenset({"extra_keys"})
# The first of a block's ``extra_keys`` when it holds image positions (vLLM's are its
# multimodal identifiers).
MEDIA_KEY = "mm"
# The replay stream's last frame carries seq -1 (signed), with an empty topic and payload.
END_SEQ = struct.pack(">q", -1)
# vllm-router refuses a batch of more than this many events (and payloads over 16 MiB).
MAX_EVENTS_PER_BATCH = 4096

Event = dict[str, Any]


def block_stored(
    hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str = MEDIUM_DEVICE,
    *,
    lora_id: int | None = None,
    lora_name: str | None = None,
    session_id: str | None = None,
) -> Event:
    """``lora_id``, ``lora_name``: the LoRA adapter (set) the blocks were computed under (None: the base model).
    ``session_id`` (ours, map encoding only: a key vLLM's structs do not have, which the
    array layout leaves out): the agent session whose turn stored the blocks.

    A negative id is a position that holds an image, not a vocabulary token (its id in the
    engine's token lists: ``-1 - v``, v < 2**31 a hash of the image and the position):
    consumers read ``token_ids`` as unsigned 32-bit (llm-d's indexer) or 32-bit ints, so it
    goes out as ``v``, and each block holding such positions carries
    ``extra_keys[i] = ("mm", <xxh3-64 hex of its v>)``, as vLLM names a block's multimodal
    inputs there (None for a block without; no ``extra_keys`` when no block has any)."""
    ids = list(token_ids)
    event = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": ids,
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }
    if ids and min(ids) < 0:
        event["token_ids"] = [t if t >= 0 else -1 - t for t in ids]
        event["extra_keys"] = [_media_key(ids[i : i + block_size]) for i in range(0, len(ids), block_size)]
    if session_id is not None:
        event["session_id"] = session_id
    return event


def _media_key(block: Sequence[int]) -> tuple[str, str] | None:
    media = [-1 - t for t in block if t < 0]
    return (MEDIA_KEY, f"{xxh3_64(array('I', media).tobytes()):016x}") if media else None


def block_removed(hashes: Sequence[int], medium: str = MEDIUM_DEVICE) -> Event:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_blocks_cleared() -> Event:
    return {"type": "AllBlocksCleared"}


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(raw: bytes) -> int:
    """A frame's seq, signed (END_SEQ reads -1)."""
    if len(raw) != 8:
        raise ValueError(f"a seq frame is 8 bytes, got {len(raw)}")
    return int(struct.unpack(">q", raw)[0])


def encode_batch(ts: float, events: Sequence[Event], dp_rank: int | None = None, encoding: str = "map") -> bytes:
    """The payload ``[ts, events, dp_rank]``; ``encoding`` "array" lays each event out as
    ``[tag, *fields]`` in vLLM's field order instead of a map."""
    if encoding == "array":
        events = [[ev["type"], *(ev[f] for f in _FIELDS[ev["type"]] if f in ev or f not in _OPTIONAL)]
                  for ev in events]
    return msgpack.packb([ts, list(events), dp_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """A payload of either encoding, its events as maps."""
    ts, events, *rank = msgpack.unpackb(payload, raw=False)
    return float(ts), [_as_map(ev) for ev in events], rank[0] if rank else None


def _as_map(ev: Any) -> Event:
    if isinstance(ev, list):  # "array": [tag, *fields]; trailing defaults may be left off
        fields = _FIELDS.get(ev[0], ())
        return {
            "type": ev[0],
            **{f: (ev[i + 1] if i + 1 < len(ev) else None) for i, f in enumerate(fields)
               if i + 1 < len(ev) or f not in _OPTIONAL},
        }
    return dict(ev)


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends the replay socket (the ROUTER sees its identity frame first)."""
    return [b"", encode_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int] | None:
    """(peer identity, start_seq) of a request the ROUTER received; None when malformed."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return frames[0], int.from_bytes(frames[2], "big")
