"""The RPC clients never read another call's reply: an exchange interrupted mid-way (cancelled,
timed out) closes the connection, and the next call says so instead of reading a stale reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from helpers import ENGINE, MESSAGES, rpc
from hydra_trio.rpc.client import RpcConnectionClosed, SyncRpcClient


@pytest.fixture
async def engine(start_engine: Any, tiny_model: Path) -> Any:
    return await start_engine(tiny_model, **ENGINE)


async def test_a_call_cancelled_mid_exchange_closes_the_connection(engine: Any) -> None:
    """STATE_GET waits for the GPU worker (held by the test); the caller gives up. Once the
    worker is free the server still answers that STATE_GET: reused, the connection would hand
    that reply to the next call (INFO)."""
    async with await rpc(engine) as c:
        await c.prefill(0, {"messages": MESSAGES})
        async with engine.state.engine._core.worker.limiter:
            with trio.CancelScope() as scope:

                async def cancel_when_blocked() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    scope.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_when_blocked)
                    await c.state_get(0)
            assert scope.cancelled_caught
        with pytest.raises(RpcConnectionClosed, match="interrupted"):
            await c.info()
    async with await rpc(engine) as fresh:  # the engine itself is fine
        assert (await fresh.info()).meta["engine"] == "hydra-trio"


async def test_a_sync_call_that_timed_out_closes_the_connection(engine: Any) -> None:
    client = await trio.to_thread.run_sync(lambda: SyncRpcClient("127.0.0.1", engine.rpc_port, timeout=0.3))
    try:
        await trio.to_thread.run_sync(client.prefill, 0, {"messages": MESSAGES})
        async with engine.state.engine._core.worker.limiter:  # STATE_GET cannot answer in 0.3 s
            with pytest.raises(TimeoutError):
                await trio.to_thread.run_sync(client.state_get, 0)
        with pytest.raises(RpcConnectionClosed, match="interrupted"):
            await trio.to_thread.run_sync(client.info)
    finally:
        client.close()
