"""A free loopback port, the one way tests and benchmarks pick one."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now (the OS picks it; another process could take
    it before ours binds, so servers started in-process bind port 0 instead)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
