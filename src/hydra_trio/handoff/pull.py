"""The decode side of KV_PULL: fetch one export from a prefill engine over the binary RPC.

One request on a fresh connection: the reply's sizes are checked against this engine's
caps before anything is read (a peer cannot make us allocate more than ``max_kv_bytes``),
the payload is read into one preallocated buffer and hashed as it arrives (each read as it
lands: transport.recv_exactly_hashing), and its bytes are checked against the hash the export was
announced with. The caller's cancel scope bounds everything; leaving
it closes the connection, which is all the prefill engine needs to let the bytes go.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from ..concurrency import run_cpu_bound
from ..config import IPNetwork
from ..transport import PeerClosed, draining_recv_into, payload_buffer, read_reply_head, recv_exactly_hashing
from ..wire.errors import ErrorCode, ProtocolError, Status
from ..wire.kvpull import HandoffParams, check_pulled, encode_pull_request
from ..wire.protocol import Op, encode_request
from .shm import discard_export, map_export, shares_folder

_MAX_META_BYTES = 1 << 20
# The one reason a client sees for every failure of the network exchange: nothing listens,
# nothing answers in time, or what answers is not a KV_PULL reply of that export. Telling
# those apart would let any HTTP client map which ports are closed, silent or open behind
# the engine; the cause stays in the detail, for the engine's own log.
PULL_FAILED = "pull_failed"


class PullFailed(Exception):
    """The export could not be pulled; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def network_failure(cause: str, detail: str) -> PullFailed:
    """The one home of the collapse: ``cause`` (unreachable, timeout, bad_reply) goes into
    the detail only, never into the reason."""
    return PullFailed(PULL_FAILED, f"{cause}: {detail}")


@dataclass(slots=True)
class Pulled:
    meta: dict[str, Any]
    # One payload buffer (rpc/connection.py), not zero-filled; or a private mapping of the
    # export's shared-memory file (transport "shm")
    blob: np.ndarray
    transport: str = "tcp"


async def allowed_address(host: str, port: int, allow: Sequence[IPNetwork]) -> str:
    """The address to connect to for ``host``: the first it resolves to inside ``allow``
    (checked on the resolved address, which is then the one connected to, so a name cannot
    resolve elsewhere between the check and the connect); PullFailed("not_allowed")."""
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise network_failure("unreachable", f"cannot resolve {host}: {exc}") from None
    except (UnicodeError, ValueError) as exc:  # a name the resolver cannot even encode
        raise PullFailed("bad_params", f"remote_host {host!r}: {exc}") from None
    addresses = [info[4][0] for info in infos]
    for addr in addresses:
        ip = ipaddress.ip_address(addr.split("%")[0])
        if any(ip.version == net.version and ip in net for net in allow):
            return addr
    raise PullFailed("not_allowed", f"{host} ({', '.join(sorted(set(addresses)))}) is outside --kv-pull-allow")


async def pull_export(
    params: HandoffParams,
    *,
    allow: Sequence[IPNetwork],
    trace: str = "",
    reserve: Callable[[int], Awaitable[None]] | None = None,
) -> Pulled:
    """The export's blob, verified; PullFailed otherwise. Bounded by the caller's scope; the
    caller has checked ``params.kv_bytes`` against --max-kv-bytes. ``reserve(n)`` is awaited
    once the peer's reply announces the export's ``n`` bytes, before they are received or
    mapped (the payload budget's charge, which the caller releases): a peer that is gone,
    refuses or answers something else never costs budget."""
    address = await allowed_address(params.host, params.port, allow)
    # Shared memory only when this process reads the prefill engine's probe: never assumed.
    shm = shares_folder(params.shm)
    try:
        stream = await trio.open_tcp_stream(address, params.port)
    except OSError as exc:
        raise network_failure("unreachable", f"cannot connect to {params.host}:{params.port}: {exc}") from None
    async with stream:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = stream.socket
        handed: object = None  # a shared file the reply handed over, until it is mapped
        digest: int | None = None  # the received bytes' hash, taken as they came
        try:
            pull = encode_pull_request(params.export_id, shm=shm)
            request = encode_request(Op.KV_PULL, b"", pull, trace.encode()[:200])
            await stream.send_all(request)
            head, meta = await read_reply_head(sock.recv_into, max_meta_bytes=_MAX_META_BYTES)
            if head.status != Status.OK:
                code = str(meta.get("error_code", ""))
                reason = "not_found" if code == ErrorCode.EXPORT_NOT_FOUND else "refused"
                raise PullFailed(reason, f"KV_PULL refused: {code}: {meta.get('error', '')}")
            if shm and meta.get("transport") == "shm":
                handed = meta.get("shm_path")  # ours to unlink now, whatever happens next
            if handed is not None and head.payload_len == 0:
                if meta.get("kv_bytes") != params.kv_bytes:  # before anything is mapped
                    raise network_failure(
                        "bad_reply", f"KV_PULL reply holds {meta.get('kv_bytes')!r} bytes; the export has "
                        f"{params.kv_bytes}"
                    )
                if reserve is not None:
                    await reserve(params.kv_bytes)
                blob = await trio.to_thread.run_sync(_mapped, handed, params)
                handed = None  # mapped, and unlinked by the mapping
                transport = "shm"
            else:
                if head.payload_len != params.kv_bytes:
                    raise network_failure(
                        "bad_reply", f"KV_PULL reply announces {head.payload_len} bytes; the export has "
                        f"{params.kv_bytes}"
                    )
                if reserve is not None:
                    await reserve(head.payload_len)
                blob = payload_buffer(head.payload_len)  # the one buffer the KV lives in until restored
                digest = await recv_exactly_hashing(draining_recv_into(sock), memoryview(blob), (0, len(blob)))
                transport = "tcp"
        except PeerClosed as exc:
            if exc.cause is None:
                raise network_failure(
                    "unreachable", f"prefill engine closed the connection after {exc.got}/{exc.n} bytes"
                ) from None
            raise network_failure("unreachable", f"KV_PULL from {params.host}:{params.port}: {exc.cause}") from None
        except (OSError, trio.BrokenResourceError) as exc:
            raise network_failure("unreachable", f"KV_PULL from {params.host}:{params.port}: {exc}") from None
        except (ValueError, ProtocolError) as exc:  # bad JSON, malformed header
            raise network_failure("bad_reply", f"KV_PULL reply: {exc}") from None
        finally:
            if handed is not None:  # a failure (or a cancellation) after the reply
                discard_export(handed, params.shm.get("probe", ""))
    try:
        await run_cpu_bound(lambda: check_pulled(params, meta, blob, digest), 0 if digest is not None else len(blob))
    except ProtocolError as err:
        if err.code == ErrorCode.HASH_MISMATCH:
            raise PullFailed("hash_mismatch", err.message) from None
        raise network_failure("bad_reply", err.message) from None
    return Pulled(meta, blob, transport)


def _mapped(path: object, params: HandoffParams) -> np.ndarray:
    """The export's shared file, mapped (and unlinked: handoff/shm.py); PullFailed otherwise.
    The hash is checked on these bytes afterwards, as on received ones."""
    if not isinstance(path, str):
        raise network_failure("bad_reply", "KV_PULL reply names no shared-memory file")
    try:
        mapping = map_export(path, params.kv_bytes, params.shm["probe"])
    except OSError as exc:
        raise network_failure("bad_reply", f"cannot map the export's shared-memory file: {exc}") from None
    return np.frombuffer(mapping, dtype=np.uint8)
