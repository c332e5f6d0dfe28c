"""The CURVE keys of the KV events' sockets (``--kv-events-curve-secret-key-file``, a Z85 key
or a zmq.auth certificate; ``--kv-events-curve-allowed-keys-file``, the client keys let in),
read and checked at start: a setting that cannot be used stops the start with one line
naming it. Apart from the publisher (kv_publisher.py): key files change with how operators
hold keys, the publisher with the events' protocol."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from ..config import Settings

__all__ = ["CurveKeys", "load_curve_keys"]


@dataclass(frozen=True, slots=True)
class CurveKeys:
    secret: bytes  # Z85
    public: bytes  # Z85, derived from the secret: subscribers need it
    allowed: frozenset[bytes] | None  # raw 32-byte client keys; None: any client


def load_curve_keys(settings: Settings) -> CurveKeys | None:
    """The CURVE keys of ``--kv-events-curve-*`` (None: CURVE off); SystemExit naming the
    setting when libzmq lacks CURVE or a file is unreadable or malformed."""
    path = settings.kv_events_curve_secret_key_file
    if not path:
        return None
    name = "kv_events_curve_secret_key_file"
    if not zmq.has("curve"):
        raise SystemExit(f"{name}: this libzmq ({zmq.zmq_version()}) was built without CURVE; unset it or install a "
                         "libzmq with CURVE (libsodium)")
    text = _read(path, name)
    if "curve_secret_key" in text:  # a zmq.auth certificate (zmq.auth.create_certificates)
        try:
            _, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{name}: {path}: {exc}") from None
        if secret is None:
            raise SystemExit(f"{name}: {path} is a public certificate; give the secret one (.key_secret)")
    else:
        keys = _key_lines(text, path, name)
        if not keys:
            raise SystemExit(f"{name}: {path} holds no key")
        secret = keys[0]
    allowed = None
    if settings.kv_events_curve_allowed_keys_file:
        allowed_name = "kv_events_curve_allowed_keys_file"
        allowed_path = settings.kv_events_curve_allowed_keys_file
        keys = _key_lines(_read(allowed_path, allowed_name), allowed_path, allowed_name)
        allowed = frozenset(zmq.utils.z85.decode(k) for k in keys)
    return CurveKeys(secret=secret, public=zmq.curve_public(secret), allowed=allowed)


def _read(path: str, name: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{name}: cannot read {path}: {exc}") from None


def _key_lines(text: str, path: str, name: str) -> list[bytes]:
    """Z85 keys, one a line; blank lines and other lines starting with # are skipped ("#" is
    a Z85 digit: a key may start with it, and no comment can follow a key)."""
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        key = line.strip().encode("ascii", "replace")
        if _is_z85_key(key):
            keys.append(key)
        elif key and not key.startswith(b"#"):
            raise SystemExit(f"{name}: {path} line {n} is not a Z85 CURVE key (40 characters)")
    return keys


def _is_z85_key(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(zmq.utils.z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError, struct.error):  # z85.decode's ways of refusing
        return False
