"""`python -m benchmarks.handoff_parts [--mb 148.5] [--repeats 5]`

Where a TCP hand-off's time goes on this machine, by part (issue 53): one blob of
``--mb`` MB over loopback from a sender process to this one, received

- ``raw``: blocking ``sendall`` / ``recv_into`` into a buffer written before (the floor);
- ``raw_fresh``: the same into a new anonymous mapping each time (what page faults cost);
- ``trio``: the engine's own sides, a trio sender (rpc/connection.py ``Connection.send``,
  as the listener sends a KV_PULL reply) and ``recv_exactly`` into ``payload_buffer``;
- ``trio_hash``: the same with ``recv_exactly_hashing`` (XXH3 behind it) over trio's
  ``recv_into`` (the pull's read before issue 53);
- ``drain_hash``: the same over ``draining_recv_into`` (the pull's read now);
- ``drain_inline``: ``draining_recv_into`` with XXH3 on the event loop's thread, each read
  hashed as it lands (no hashing thread beside the receive: a variant, not the engine's);
- ``hash``: XXH3-64 of the blob alone, in memory.

Also the socket buffer sizes each side gets. Median ms and GB/s; writes
benchmarks/results/handoff-parts.json. The sender runs in its own process, as the
prefill engine does.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import trio
import xxhash

from hydra_trio.rpc.connection import Connection
from hydra_trio.transport import draining_recv_into, payload_buffer, recv_exactly, recv_exactly_hashing

from .__main__ import RESULTS
from .harness import env_info


def _serve(port: int, n: int, mode: str) -> None:
    """The sender: one blob of ``n`` bytes per connection, ``mode`` raw or trio."""
    blob = mmap.mmap(-1, n)
    blob.write(os.urandom(1 << 20) * (n >> 20) + b"\0" * (n - (n >> 20 << 20)))
    view = memoryview(blob)
    if mode == "raw":
        ls = socket.create_server(("127.0.0.1", port))
        print("ready", flush=True)
        while True:
            c, _ = ls.accept()
            if c.recv(1) != b"g":
                return
            c.sendall(view)
            c.close()

    async def main() -> None:
        async def one(stream: trio.SocketStream) -> None:
            conn = Connection(stream, 30.0)
            if await stream.receive_some(1) != b"g":
                raise SystemExit(0)
            await conn.send([view])
            await stream.aclose()

        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        print("ready", flush=True)
        await trio.serve_listeners(one, listeners)

    try:
        trio.run(main)
    except SystemExit:
        return


def _sender(n: int, mode: str) -> tuple[subprocess.Popen[str], int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.handoff_parts", "--serve", str(port), "--mb", str(n / 1e6), "--mode", mode],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, port


def _raw(port: int, n: int, fresh: bool, keep: list[Any]) -> float:
    buf = mmap.mmap(-1, n) if fresh or not keep else keep[0]
    if not keep:
        buf.write(b"\1" * n)  # written before: its pages are there
        keep.append(buf)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"g")
        got = 0
        while got < n:
            k = c.recv_into(view[got:], n - got)
            if k == 0:
                raise RuntimeError("sender closed early")
            got += k
    dt = time.perf_counter() - t0
    view.release()
    return dt


async def _trio(port: int, n: int, hashing: bool, drain: bool = False, inline: bool = False) -> float:
    t0 = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await stream.send_all(b"g")
        buf = payload_buffer(n)
        view = memoryview(buf)
        recv_into = draining_recv_into(stream.socket) if drain else stream.socket.recv_into
        if inline:  # hashed on the event loop's thread, each read as it lands
            await recv_exactly(recv_into, view, on_progress=_inline_hasher(view))
        elif hashing:
            await recv_exactly_hashing(recv_into, view, (0, n))
        else:
            await recv_exactly(recv_into, view)
        view.release()
        del view, buf
    return time.perf_counter() - t0


def _inline_hasher(view: memoryview) -> Any:
    hasher, done = xxhash.xxh3_64(), [0]

    def progress(got: int) -> None:
        hasher.update(view[done[0] : got])
        done[0] = got

    return progress


def _bufsizes() -> dict[str, int]:
    s = socket.socket()
    try:
        return {"SO_RCVBUF": s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
                "SO_SNDBUF": s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                **{k: int(open(f"/proc/sys/net/ipv4/{k}").read().split()[-1]) for k in ("tcp_rmem", "tcp_wmem")}}
    finally:
        s.close()


def run(mb: float, repeats: int) -> dict[str, Any]:
    n = int(mb * 1e6)
    out: dict[str, Any] = {"bytes": n, "socket": _bufsizes(), "load_before": os.getloadavg()}
    for mode in ("raw", "trio"):
        proc, port = _sender(n, mode)
        try:
            if mode == "raw":
                keep: list[Any] = []
                _raw(port, n, False, keep)  # warm the buffer and the sender
                cases = {"raw": lambda: _raw(port, n, False, keep), "raw_fresh": lambda: _raw(port, n, True, [])}  # noqa: B023 (called in this iteration)
            else:
                trio.run(_trio, port, n, False)
                cases = {"trio": lambda: trio.run(_trio, port, n, False),  # noqa: B023
                         "trio_hash": lambda: trio.run(_trio, port, n, True),  # noqa: B023
                         "drain_hash": lambda: trio.run(_trio, port, n, True, True),  # noqa: B023
                         "drain_inline": lambda: trio.run(_trio, port, n, True, True, True)}  # noqa: B023
            for name, fn in cases.items():
                out[name] = [fn() * 1000.0 for _ in range(repeats)]
        finally:
            proc.kill()
            proc.wait()
    data = np.frombuffer(os.urandom(1 << 20) * (n >> 20), dtype=np.uint8)
    hashes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(data)
        hashes.append((time.perf_counter() - t0) * 1000.0)
    out["hash"] = hashes
    out["load_after"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=148.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="raw", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        _serve(args.serve, int(args.mb * 1e6), args.mode)
        return 0
    res = run(args.mb, args.repeats)
    n = res["bytes"]
    for name in ("raw", "raw_fresh", "trio", "trio_hash", "drain_hash", "drain_inline", "hash"):
        med = statistics.median(res[name])
        print(f"{name:10s} median {med:7.1f} ms  ({n / med / 1e6:5.2f} GB/s)  all {[round(x) for x in res[name]]}")
    print(f"socket {res['socket']}; load {res['load_before']} -> {res['load_after']}")
    out = RESULTS / "handoff-parts.json"
    out.write_text(json.dumps({**res, "env": env_info()}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
