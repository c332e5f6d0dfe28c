"""The export store (decode/exports.py) on trio's virtual clock: leases end on time, the
store stays under its byte bound by evicting the oldest, an export is served once."""

from __future__ import annotations

import pytest
import trio
from prometheus_client import CollectorRegistry

from hydra_trio.decode.exports import ExportStore


def _store(max_bytes: int = 1000, ttl_s: float = 30.0) -> tuple[ExportStore, CollectorRegistry]:
    registry = CollectorRegistry()
    return ExportStore(max_bytes=max_bytes, ttl_s=ttl_s, registry=registry), registry


def _count(registry: CollectorRegistry, outcome: str) -> float:
    value = registry.get_sample_value("hydra_kv_exports_total", {"outcome": outcome})
    return value or 0.0


IDENTITY = {"model_alias": "tiny", "model_name": "Tiny"}


def _blob(n: int) -> list[bytes | bytearray]:
    return [b"h" * 10, bytearray(n - 10)]


async def test_served_once_and_bytes_returned() -> None:
    store, registry = _store()
    export = store.put(_blob(300), 7, "xxh3:0000000000000001", IDENTITY)
    assert export is not None and len(export.id) == 22
    assert len(store) == 1 and store.bytes_held == 300
    assert registry.get_sample_value("hydra_kv_export_bytes") == 300
    assert store.take(export.id) is export
    assert store.take(export.id) is None  # released once pulled
    assert len(store) == 0 and store.bytes_held == 0
    assert (_count(registry, "created"), _count(registry, "pulled")) == (1, 1)


async def test_the_oldest_are_evicted_to_stay_under_the_bound() -> None:
    store, registry = _store(max_bytes=1000)
    ids = [store.put(_blob(400), 1, "xxh3:0000000000000001", IDENTITY).id for _ in range(3)]  # type: ignore[union-attr]
    assert store.bytes_held == 800 and len(store) == 2
    assert store.take(ids[0]) is None  # the oldest made room for the third
    assert store.take(ids[1]) is not None and store.take(ids[2]) is not None
    assert _count(registry, "evicted") == 1


async def test_larger_than_the_bound_alone_is_refused() -> None:
    store, registry = _store(max_bytes=1000)
    kept = store.put(_blob(600), 1, "xxh3:0000000000000001", IDENTITY)
    assert store.put(_blob(1001), 1, "xxh3:0000000000000001", IDENTITY) is None
    assert _count(registry, "refused") == 1
    assert kept is not None and store.take(kept.id) is kept  # nothing was evicted for it


async def test_leases_end_on_time_without_any_access(nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    store, registry = _store(ttl_s=30.0)
    await nursery.start(store.run)
    t0 = trio.current_time()
    first = store.put(_blob(100), 1, "xxh3:0000000000000001", IDENTITY)
    await trio.sleep(10)
    second = store.put(_blob(100), 1, "xxh3:0000000000000001", IDENTITY)
    assert first is not None and second is not None
    while len(store) == 2:
        await store.wait_changed()
    assert trio.current_time() - t0 == pytest.approx(30.0)  # the first lease, to the second
    assert store.take(first.id) is None and store.bytes_held == 100
    while len(store):
        await store.wait_changed()
    assert trio.current_time() - t0 == pytest.approx(40.0)
    assert store.take(second.id) is None and store.bytes_held == 0
    assert _count(registry, "expired") == 2


async def test_taking_an_expired_export_fails_even_before_the_sweeper_runs(autojump_clock: trio.abc.Clock) -> None:
    store, _ = _store(ttl_s=1.0)
    export = store.put(_blob(100), 1, "xxh3:0000000000000001", IDENTITY)
    assert export is not None
    await trio.sleep(1.0)
    assert store.take(export.id) is None


async def test_stopping_the_store_drops_every_export(autojump_clock: trio.abc.Clock) -> None:
    store, _ = _store()
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        store.put(_blob(100), 1, "xxh3:0000000000000001", IDENTITY)
        nursery.cancel_scope.cancel()
    assert len(store) == 0 and store.bytes_held == 0
