"""KV_PULL (op 0x47, ours) and the ``kv_transfer_params`` a router carries between engines.

A prefill engine that keeps a prompt's KV as an *export* answers its HTTP completion with
``kv_transfer_params`` naming the export (``export_params``). A router (vllm-router's P/D
mode) copies that object unchanged into the request it sends to a decode engine, which
recognises it (``parse_handoff_params``) and pulls the KV over the binary RPC:

request:  header op 0x47, empty key, payload JSON ``{"export_id": "<id>"}`` (≤ 4 KiB)
reply OK: meta ``{"export_id", "n_past", "state_size", "kv_bytes", "kv_hash", identity...}``,
          payload the v2 KV blob (spec §3) with the last position's logits

Pure: importable without llama_cpp. Every refusal is a ``ProtocolError``.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ErrorCode, ProtocolError
from .hashing import format_tag, parse_tag, xxh3_64
from .jsontext import parse_json_object

Buffer = bytes | bytearray | memoryview

KV_PULL_MAX_REQUEST_BYTES = 4096
HANDOFF_VERSION = 1
ENGINE_ID = "hydra-trio"
# An export id is a capability: 128 random bits, URL-safe base64 (22 chars); accept a range so
# the format may grow without breaking older decoders.
_EXPORT_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
# A host name (RFC 1123 labels of 1..63 letters, digits, hyphens; underscores as DNS allows
# them in practice), at most 253 characters, one trailing dot at most; or an IP literal.
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_MAX_PATH = 4096  # PATH_MAX: longer is no file name
# Identity fields a handoff carries (spec §2 plus the tokenizer hash; never the model path).
IDENTITY_KEYS = ("model_alias", "tokenizer", "tokenizer_hash", "model_name", "model_quant", "model_capabilities")


@dataclass(frozen=True, slots=True)
class HandoffParams:
    """What a decode engine needs to pull an export (parsed from ``kv_transfer_params``)."""

    host: str
    port: int
    export_id: str
    n_past: int
    kv_hash: str
    kv_bytes: int
    identity: dict[str, Any]
    # The KV cache layout the export was made in (type_k, type_v, v_trans); {}: not said
    # (an older prefill engine), and the restore's own layout check decides.
    kv_cache: dict[str, Any] = field(default_factory=dict)
    shm: dict[str, str] = field(default_factory=dict)  # the prefill engine's probe (handoff/shm.py)


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FRAME, f"kv_transfer_params: {msg}")


def check_export_id(value: object) -> str:
    if not isinstance(value, str) or not _EXPORT_ID.fullmatch(value):
        shown = value[:40] if isinstance(value, str) else type(value).__name__
        raise ProtocolError(ErrorCode.BAD_FRAME, f"malformed export id {shown!r}")
    return value


# ---- the RPC request ------------------------------------------------------------------------


def encode_pull_request(export_id: str, *, shm: bool = False) -> bytes:
    """``shm``: the puller can map the export's shared-memory file (same host, handoff/shm.py)."""
    body: dict[str, Any] = {"export_id": check_export_id(export_id)}
    if shm:
        body["shm"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def parse_pull_request(payload: Buffer) -> tuple[str, bool]:
    """(the export id a KV_PULL names, whether the puller takes the shared-memory form);
    BAD_JSON / BAD_FRAME otherwise."""
    if len(payload) > KV_PULL_MAX_REQUEST_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"KV_PULL payload of {len(payload)} bytes exceeds "
                            f"{KV_PULL_MAX_REQUEST_BYTES}")
    body = parse_json_object(payload, "KV_PULL")
    return check_export_id(body.get("export_id")), body.get("shm") is True


# ---- kv_transfer_params --------------------------------------------------------------------


def wants_remote_decode(params: object) -> bool:
    """The prefill request of a P/D router: ``kv_transfer_params.do_remote_decode`` is true."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def export_params(
    *,
    host: str,
    port: int,
    export_id: str,
    n_past: int,
    kv_hash: str,
    kv_bytes: int,
    ttl_s: float,
    identity: Mapping[str, Any],
    shm: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill reply. The vLLM keys keep their meaning (this
    side did the prefill; the decode side pulls from ``remote_host:remote_port``); what a
    hydra decode engine needs is under ``"hydra"``."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": ENGINE_ID,
        "remote_block_ids": None,
        "remote_host": host,
        "remote_port": port,
        "hydra": {
            "v": HANDOFF_VERSION,
            "op": "KV_PULL",
            "export_id": check_export_id(export_id),
            "n_past": n_past,
            "kv_hash": kv_hash,
            "kv_bytes": kv_bytes,
            "ttl_s": ttl_s,
            # "lora" (ours, only under adapters): the LoRA adapter set the KV was made under.
            **{k: identity[k] for k in (*IDENTITY_KEYS, "kv_cache", "lora") if k in identity},
            # Where a decode engine on the same host can tell it shares memory with this one.
            **({"shm": dict(shm)} if shm else {}),
        },
    }


def check_host(value: object) -> str:
    """``remote_host`` as the resolver may be given it: an IP literal or a well-formed
    host name; BAD_FRAME otherwise (``"a..b"``, a 64-character label, ``"."``, a NUL: the
    resolver's own errors for those are not a network's answer)."""
    if not isinstance(value, str) or not value or len(value) > 253 or not value.isascii():
        raise _bad("remote_host must be a host name or address")
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value
    if not name or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise _bad("remote_host must be a host name or address")
    return value


def _shm(value: object) -> dict[str, str]:
    """The prefill engine's probe (handoff/shm.py), and its network namespace when told
    (a decode engine in another one does not map its files): {} when not announced."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad("shm must be an object of probe and token (strings)")
    out = {k: value[k] for k in ("probe", "token") if k in value}
    if set(out) != {"probe", "token"} or not all(
        isinstance(v, str) and 0 < len(v) <= _MAX_PATH and "\0" not in v for v in out.values()
    ):
        raise _bad("shm must be an object of probe and token (strings)")
    netns = value.get("netns")
    if netns is not None:
        if not isinstance(netns, str) or not 0 < len(netns) <= 64:
            raise _bad("shm.netns must be a string of at most 64 characters")
        out["netns"] = netns
    return out


def _int(obj: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{key} must be an integer in {lo}..{hi}")
    return v


def parse_handoff_params(params: object) -> HandoffParams | None:
    """The hydra export a request's ``kv_transfer_params`` names, or None when it names none
    (absent, another connector's keys, the prefill-side request). A ``"hydra"`` object that
    is malformed is a BAD_FRAME: the caller reports it and prefills locally."""
    if not isinstance(params, Mapping) or "hydra" not in params:
        return None
    h = params["hydra"]
    if not isinstance(h, Mapping):
        raise _bad("hydra must be an object")
    if h.get("v") != HANDOFF_VERSION:
        raise _bad(f"unsupported hydra handoff version {h.get('v')!r}")
    host = check_host(params.get("remote_host"))
    port = _int(params, "remote_port", 1, 65535)
    kv_hash = h.get("kv_hash")
    if parse_tag(kv_hash, "kv_transfer_params.hydra.kv_hash") is None:
        raise _bad("kv_hash is required")
    assert isinstance(kv_hash, str)
    # The adapter set ("lora") travels as a claim: the identity gate checks its shape.
    identity = {k: h[k] for k in (*IDENTITY_KEYS, "lora") if k in h}
    kv_cache = h.get("kv_cache", {})
    if not isinstance(kv_cache, Mapping) or not all(
        isinstance(kv_cache.get(k, ""), str) for k in ("type_k", "type_v")
    ) or not isinstance(kv_cache.get("v_trans", False), bool):
        raise _bad("kv_cache must be an object of type_k, type_v (strings) and v_trans (bool)")
    return HandoffParams(
        host=host,
        port=port,
        export_id=check_export_id(h.get("export_id")),
        n_past=_int(h, "n_past", 1, 1 << 24),
        kv_hash=kv_hash.lower(),
        kv_bytes=_int(h, "kv_bytes", 1, 1 << 62),
        identity=identity,
        kv_cache={k: kv_cache[k] for k in ("type_k", "type_v", "v_trans") if k in kv_cache},
        shm=_shm(h.get("shm")),
    )


def check_pulled(params: HandoffParams, meta: Mapping[str, Any], payload: Buffer, digest: int | None = None) -> None:
    """The reply is the export the params named, byte for byte: HASH_MISMATCH or BAD_FRAME.
    ``digest``: the payload's XXH3-64, when it was hashed as it arrived."""
    if meta.get("export_id") != params.export_id:
        raise ProtocolError(ErrorCode.BAD_FRAME, "KV_PULL reply names another export")
    if len(payload) != params.kv_bytes or meta.get("kv_bytes") != params.kv_bytes:
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"KV_PULL reply holds {len(payload)} bytes; the export has {params.kv_bytes}"
        )
    if meta.get("n_past") != params.n_past:
        raise ProtocolError(ErrorCode.BAD_FRAME, "KV_PULL reply n_past differs from the export's")
    expected = parse_tag(params.kv_hash, "kv_hash")
    actual = xxh3_64(payload) if digest is None else digest
    if actual != expected or str(meta.get("kv_hash", "")).lower() != params.kv_hash:
        raise ProtocolError(ErrorCode.HASH_MISMATCH, f"KV_PULL: kv hash mismatch (export {params.kv_hash}, got "
                            f"{format_tag(actual)})")


__all__ = [
    "ENGINE_ID",
    "HANDOFF_VERSION",
    "IDENTITY_KEYS",
    "KV_PULL_MAX_REQUEST_BYTES",
    "HandoffParams",
    "check_export_id",
    "check_host",
    "check_pulled",
    "encode_pull_request",
    "export_params",
    "parse_handoff_params",
    "parse_pull_request",
    "wants_remote_decode",
]
