"""Talking to a peer: receiving its bytes (``receive.py``: the payload buffer, the one
exact-length read, the one RPC reply reader, for every side), sending a large reply
(``send.py``: the draining send) and the async HTTP client for decode results
(``http_client.py``)."""

from .http_client import DecodeHttpClient, auth_headers
from .receive import (
    PeerClosed,
    RecvInto,
    draining_recv_into,
    payload_buffer,
    read_reply_head,
    recv_bytes,
    recv_exactly,
    recv_exactly_hashing,
    run_blocking,
)
from .send import draining_send

__all__ = [
    "DecodeHttpClient",
    "PeerClosed",
    "RecvInto",
    "auth_headers",
    "draining_recv_into",
    "draining_send",
    "payload_buffer",
    "read_reply_head",
    "recv_bytes",
    "recv_exactly",
    "recv_exactly_hashing",
    "run_blocking",
]
