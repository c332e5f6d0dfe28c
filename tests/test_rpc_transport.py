"""RPC transport hardening on a live engine: a peer that stops reading is closed after the
idle timeout and frees what it held."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import gguf
import pytest
import trio

from _helpers import rpc, wait_until
from hydra_trio.wire.protocol import RESPONSE_HEADER, Op, encode_request_header


@pytest.fixture(scope="module")
def wide_kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 layers x 256 wide, full KV heads: 16 KB of KV per token, so a few hundred tokens
    make a slot larger than what loopback socket buffers absorb (the sender's buffer
    autotunes up to net.ipv4.tcp_wmem's 4 MB maximum)."""
    from hydra_trio.model import synthetic

    preset = synthetic.Preset(512, 256, 16, 4, 4, 64, 4096, gguf.LlamaFileType.MOSTLY_F16, "Hydra Wide KV")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synthetic.PRESETS, "wide-kv", preset)
        return synthetic.write_model(tmp_path_factory.mktemp("wide") / "wide-kv.gguf", "wide-kv")


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
