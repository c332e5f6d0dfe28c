"""The RPC fuzz campaign's frames (testing/rpcfuzz.py runs them): valid requests captured from
a live engine (``capture_seeds``), their mutations (``mutate``: bit flips, op and key swaps,
flags, truncations, splices, bad magic, and a DECODE's header or prompt value replaced with its
hashes recomputed, so the frame reaches validation), and hypothesis strategies of whole
requests (``hypothesis_requests``). Every frame is self-consistent: the lengths in its header
are the bytes sent."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from ..rpc.client import RpcClient, build_decode_frame, identity_kv_metadata
from ..wire.frames import encode_decode_frame_simple, encode_v3_raw
from ..wire.hashing import xxh3_tag
from ..wire.protocol import (
    MAGIC,
    REQUEST_HEADER,
    Op,
)
from .health import MESSAGES

OPS = [int(op) for op in Op] + [0x00, 0x2F, 0x47, 0xFF]
INTERESTING = [
    None, True, False, 0, -1, 1, 3, 2**31, -(2**31), 2**63, 2**64, 1e308, -0.5, "", "x",
    "0", "xxh3:0000000000000000", "\u0000", "é" * 3, [], {}, [None], {"": 1},
    "a" * 300,
]


@dataclass
class Request:
    op: int
    key: bytes
    payload: bytes
    trace: bytes = b""
    flags: int = 0
    magic: int = MAGIC

    def encode(self) -> bytes:
        head = REQUEST_HEADER.pack(
            self.magic, self.op, self.flags, len(self.key), len(self.payload), len(self.trace)
        )
        return b"".join((head, self.key, self.trace, self.payload))


# ---- frames -----------------------------------------------------------------------------------


@dataclass
class Seeds:
    """Valid requests captured from the engine, and what they were built from."""

    requests: list[Request]
    blob: bytes  # a PREFILL blob (v2, with logits)
    kv_metadata: dict[str, Any]
    decode_header: dict[str, Any]


async def capture_seeds(rpc_port: int) -> Seeds:
    async with await RpcClient.connect("127.0.0.1", rpc_port) as c:
        pre = await c.prefill(1, {"messages": MESSAGES})
        blob = bytes(pre.payload)
        kv_metadata = identity_kv_metadata(pre.meta, pre.meta["n_past"])
    chat = {"messages": MESSAGES, "n_predict": 4, "temperature": 0}
    header = {
        "v": 3,
        "model": "",
        "kv_metadata": kv_metadata,
        "model_metadata": kv_metadata,
        "generation": {"n_predict": 4, "stream": False},
    }
    requests = [
        Request(Op.INFO, b"", b""),
        Request(Op.STATE_META, b"0", b""),
        Request(Op.STATE_GET, b"1", b""),
        Request(Op.CONFIGURE, b"1", json.dumps({"n_predict": 3, "sampling": {"temperature": 0}}).encode()),
        Request(Op.PREFILL, b"0", json.dumps({"messages": MESSAGES}).encode()),
        Request(Op.STATE_PUT, b"1", blob),
        Request(Op.DECODE, b"0", build_decode_frame(chat, blob, kv_metadata=kv_metadata)),
        Request(Op.DECODE, b"1", build_decode_frame(chat, b"")),
        Request(Op.DECODE, b"0", build_decode_frame(None, b"", generation={"n_predict": 3})),
        Request(Op.DECODE, b"0", encode_decode_frame_simple({**header, "prompt": MESSAGES}, blob)),
    ]
    return Seeds(requests, blob, kv_metadata, header)


def replace_somewhere(rng: random.Random, obj: Any, depth: int = 0) -> Any:
    """A copy of a JSON value with one value somewhere replaced (or a key dropped/added)."""
    if isinstance(obj, dict) and obj and depth < 4 and rng.random() < 0.8:
        out = dict(obj)
        key = rng.choice(list(out))
        roll = rng.random()
        if roll < 0.1:
            del out[key]
        elif roll < 0.2:
            out[rng.choice(["n_predict", "stop", "stream", "seed", "messages", "prompt", "v", "x"])] = rng.choice(
                INTERESTING
            )
        else:
            out[key] = replace_somewhere(rng, out[key], depth + 1)
        return out
    if isinstance(obj, list) and obj and depth < 4 and rng.random() < 0.8:
        out_list = list(obj)
        i = rng.randrange(len(out_list))
        out_list[i] = replace_somewhere(rng, out_list[i], depth + 1)
        return out_list
    return rng.choice(INTERESTING)


def _deep_decode(rng: random.Random, seeds: Seeds) -> bytes:
    """A DECODE frame with a valid header hash and segment table, one value mutated: it gets
    past the frame checks into validation, restore and generation."""
    header = replace_somewhere(rng, seeds.decode_header) if rng.random() < 0.6 else dict(seeds.decode_header)
    chat: Any = {"messages": MESSAGES, "n_predict": rng.choice([1, 4, 16]), "temperature": 0}
    if rng.random() < 0.6:
        chat = replace_somewhere(rng, chat)
    prompt = (
        json.dumps(chat).encode() if rng.random() < 0.9 else bytes(rng.randrange(256) for _ in range(rng.randrange(8)))
    )
    kv = rng.choice([seeds.blob, b"", seeds.blob[: rng.randrange(1, len(seeds.blob))]])
    if kv and rng.random() < 0.2:
        flipped = bytearray(kv)
        flipped[rng.randrange(min(len(kv), 64))] ^= 1 << rng.randrange(8)
        kv = bytes(flipped)
    if not isinstance(header, dict):
        header = {"v": 3, "x": header}
    head = dict(header)
    head.setdefault("v", 3)
    if rng.random() < 0.9:
        head["segments"] = [
            {"id": "prompt", "offset": 0, "len": len(prompt), "hash": xxh3_tag(prompt) if rng.random() < 0.7 else ""},
            {
                "id": "kv",
                "offset": len(prompt),
                "len": len(kv),
                "hash": xxh3_tag(kv) if kv and rng.random() < 0.7 else "",
            },
        ]
    header_json = json.dumps(head, separators=(",", ":")).encode()
    return encode_v3_raw(header_json, prompt + kv)


def mutate(rng: random.Random, seeds: Seeds) -> Request:
    base = rng.choice(seeds.requests)
    req = Request(base.op, base.key, base.payload, base.trace)
    kind = rng.randrange(12)
    if kind in (0, 1) and req.payload:  # bit flips in the payload
        b = bytearray(req.payload)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        req.payload = bytes(b)
    elif kind == 2:  # another op, same body
        req.op = rng.choice(OPS)
    elif kind == 3:  # flags
        req.flags = rng.randrange(1, 256)
    elif kind == 4 and req.payload:  # truncated payload (the header says so too)
        req.payload = req.payload[: rng.randrange(len(req.payload))]
    elif kind == 5:  # extended payload
        req.payload = req.payload + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif kind == 6:  # another key
        req.key = (
            rng.choice([b"", b"0", b"1", b"2", b"-1", b" 1", b"01", b"99999999999999999999", b"x"])
            if rng.random() < 0.7
            else rng.randbytes(rng.randrange(1, 9))
        )
    elif kind == 7:  # a trace id, possibly not UTF-8
        req.trace = rng.randbytes(rng.randrange(1, 300))
    elif kind == 8:  # splice two valid payloads
        other = rng.choice(seeds.requests).payload
        cut = rng.randrange(len(req.payload) + 1)
        req.payload = req.payload[:cut] + other[rng.randrange(len(other) + 1) :]
    elif kind in (9, 10):  # structured DECODE mutation (valid hashes)
        req = Request(Op.DECODE, rng.choice([b"0", b"1"]), _deep_decode(rng, seeds))
    elif kind == 11 and rng.random() < 0.3:  # bad magic: the server closes without a reply
        req.magic = rng.randrange(1 << 16)
        if req.magic == MAGIC:
            req.magic ^= 1
    return req


def hypothesis_requests(seeds: Seeds) -> Any:
    """A hypothesis strategy of whole requests."""
    from hypothesis import strategies as st

    scalars = (
        st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False) | st.text(max_size=12)
    )
    values = st.recursive(
        scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | st.text(max_size=5) | values,
            "content": st.text(max_size=40) | values,
        }
    )
    chat = st.fixed_dictionaries(
        {},
        optional={
            "messages": st.lists(message, max_size=3) | values,
            "prompt": st.text(max_size=40) | values,
            "n_predict": st.integers(-3, 64) | values,
            "max_tokens": st.integers(-3, 64) | values,
            "temperature": st.floats(-1, 3) | values,
            "seed": st.integers(-(2**40), 2**40),
            "stop": st.lists(st.text(max_size=4), max_size=3) | values,
            "stream": st.booleans() | values,
            "tools": values,
            "add_generation_prompt": values,
        },
    )
    ident = seeds.kv_metadata
    kv_meta = st.fixed_dictionaries({}, optional={k: st.just(v) | values for k, v in ident.items()})
    header = st.fixed_dictionaries(
        {"v": st.just(3) | values},
        optional={
            "model": st.just("") | values,
            "kv_metadata": kv_meta | values,
            "model_metadata": kv_meta,
            "generation": chat | values,
        },
    )
    blob = seeds.blob
    kvs = st.sampled_from([b"", blob]) | st.binary(max_size=64) | st.integers(1, len(blob) - 1).map(lambda n: blob[:n])

    def v3(parts: tuple[dict[str, Any], Any, bytes, bool]) -> bytes:
        head, prompt, kv, hashed = parts
        raw = json.dumps(prompt).encode() if not isinstance(prompt, bytes) else prompt
        head = {
            **head,
            "segments": [
                {"id": "prompt", "offset": 0, "len": len(raw), "hash": xxh3_tag(raw) if hashed and raw else ""},
                {"id": "kv", "offset": len(raw), "len": len(kv), "hash": xxh3_tag(kv) if hashed and kv else ""},
            ],
        }
        try:
            header_json = json.dumps(head, separators=(",", ":")).encode()
        except ValueError:  # a float hypothesis made JSON cannot carry: send it as text
            header_json = repr(head).encode()
        return encode_v3_raw(header_json, raw + kv)

    decode_frames = st.tuples(header, chat | values | st.binary(max_size=32), kvs, st.booleans()).map(v3)
    keys = st.sampled_from([b"0", b"1", b"", b"2", b"-1", b"abc"]) | st.binary(max_size=6)

    def encode_json(v: Any) -> bytes:
        try:
            return json.dumps(v).encode()
        except ValueError:
            return repr(v).encode()

    payloads = {
        Op.DECODE: decode_frames,
        Op.PREFILL: (chat | values).map(encode_json),
        Op.CONFIGURE: st.fixed_dictionaries(
            {},
            optional={
                "n_predict": values,
                "seed": values,
                "n_keep": values,
                "antiprompt": values,
                "sampling": values,
                "state_chunk_size": values,
            },
        ).map(encode_json)
        | values.map(encode_json),
        Op.STATE_PUT: kvs,
    }
    ops = st.sampled_from(OPS)
    return ops.flatmap(
        lambda op: st.builds(
            Request,
            st.just(op),
            keys,
            payloads.get(op, st.binary(max_size=16)) if op in payloads else st.binary(max_size=16),
            st.binary(max_size=8),
            st.just(0) | st.integers(0, 255),
        )
    )
