"""RPC transport hardening on a live engine: a peer that stops reading is closed after the
idle timeout and frees what it held; peers beyond the connection bound are not accepted."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from helpers import ENGINE, rpc, wait_until
from hydra_trio.rpc.client import RpcClient
from hydra_trio.wire import Op
from hydra_trio.wire.protocol import RESPONSE_HEADER, encode_request_header


def sample(ep: Any, name: str, labels: dict[str, str] | None = None) -> float:
    return ep.state.metrics.registry.get_sample_value(name, labels or {}) or 0.0


async def test_a_peer_that_stops_reading_is_closed_and_frees_its_connection(
    start_engine: Any, wide_kv_model: Path
) -> None:
    ep = await start_engine(wide_kv_model, threads=1, slots=1, max_connections=1, idle_timeout_s=0.5)
    async with await rpc(ep) as c:
        await c.prefill(0, {"prompt": "hello world " * 80})
        state_size = (await c.state_meta(0)).meta["state_size"]
    assert state_size > 8 << 20, state_size  # well above what the socket buffers hold

    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    with sock:
        await sock.connect(("127.0.0.1", ep.rpc_port))
        await sock.send(encode_request_header(Op.STATE_GET, key_len=1, payload_len=0) + b"0")
        head = b""
        while len(head) < RESPONSE_HEADER.size:
            head += await sock.recv(RESPONSE_HEADER.size - len(head))
        # ... and read nothing more. The engine must give up on this peer on its own.
        await wait_until(lambda: _async(sample(ep, "hydra_rpc_connections") == 0), timeout_s=10)
        got = 0
        with trio.fail_after(10):
            while True:
                try:
                    k = len(await sock.recv(1 << 20))
                except ConnectionResetError:
                    break
                if k == 0:
                    break
                got += k
    assert got < state_size  # the reply was cut short: the engine closed mid-send
    async with await rpc(ep) as c:  # the one connection place (max_connections=1) is free again
        assert (await c.info()).meta["engine"] == "hydra-trio"


async def _async(value: bool) -> bool:
    return value


def accepted_sockets(port: int) -> int:
    """Server-side sockets on ``port`` that this process has accept()ed. A connection still in
    the kernel's accept queue is ESTABLISHED in /proc/net/tcp too, but no process holds it."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        if local_port == port and fields[3] == "01" and f"socket:[{fields[9]}]" in held:
            n += 1
    return n


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net/tcp")
async def test_peers_beyond_the_connection_bound_wait_in_the_kernel(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, max_connections=1, **ENGINE)
    async with await rpc(ep) as first:
        await first.info()
        # Their TCP handshakes complete (the kernel's listen backlog), but the engine holds
        # no socket beyond the bound: nothing it would have to park without a deadline.
        waiting = [await trio.open_tcp_stream("127.0.0.1", ep.rpc_port) for _ in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        assert accepted_sockets(ep.rpc_port) == 1
    # The place is free again: the first waiting peer is accepted and served, the next waits.
    async with RpcClient(waiting[0]) as second:
        with trio.fail_after(10):
            assert (await second.info()).meta["engine"] == "hydra-trio"
        await trio.testing.wait_all_tasks_blocked()
        assert accepted_sockets(ep.rpc_port) == 1
    async with RpcClient(waiting[1]) as third:
        with trio.fail_after(10):
            assert (await third.info()).meta["engine"] == "hydra-trio"


async def test_a_peer_that_stops_sending_mid_payload_frees_its_budget(start_engine: Any, tiny_model: Path) -> None:

    ep = await start_engine(tiny_model, max_connections=1, idle_timeout_s=0.3, **ENGINE)
    budget = ep.state.payload_budget
    async with await trio.open_tcp_stream("127.0.0.1", ep.rpc_port) as stream:
        await stream.send_all(
            encode_request_header(Op.STATE_PUT, key_len=1, payload_len=50_000) + b"0" + b"\x02" * 1000
        )
        await wait_until(lambda: _async(budget.used == 50_000))
        # ... and nothing more: closed after the idle timeout, its budget and place released.
        with trio.fail_after(10):
            assert await stream.receive_some() == b""
    await wait_until(lambda: _async(budget.used == 0 and sample(ep, "hydra_rpc_connections") == 0))
    async with await rpc(ep) as c:
        assert (await c.info()).meta["engine"] == "hydra-trio"
