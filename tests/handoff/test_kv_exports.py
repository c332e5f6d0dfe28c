"""The export store (handoff/exports.py) on trio's virtual clock: leases end on time, the
store stays under its byte bound by evicting the oldest, an export is served once."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from hydra_trio.handoff.exports import ExportStore
from hydra_trio.handoff.shm import ShmArea


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
    export = await store.put(_blob(300), 7, "xxh3:0000000000000001", IDENTITY)
    assert export is not None and len(export.id) == 22
    assert len(store) == 1 and store.bytes_held == 300
    assert registry.get_sample_value("hydra_kv_export_bytes") == 300
    assert store.take(export.id) is export
    assert store.take(export.id) is None  # released once pulled
    assert len(store) == 0 and store.bytes_held == 0
    assert (_count(registry, "created"), _count(registry, "pulled")) == (1, 1)


async def test_the_oldest_are_evicted_to_stay_under_the_bound() -> None:
    store, registry = _store(max_bytes=1000)
    ids = [(await store.put(_blob(400), 1, "xxh3:0000000000000001", IDENTITY)).id for _ in range(3)]  # type: ignore[union-attr]
    assert store.bytes_held == 800 and len(store) == 2
    assert store.take(ids[0]) is None  # the oldest made room for the third
    assert store.take(ids[1]) is not None and store.take(ids[2]) is not None
    assert _count(registry, "evicted") == 1


async def test_larger_than_the_bound_alone_is_refused() -> None:
    store, registry = _store(max_bytes=1000)
    kept = await store.put(_blob(600), 1, "xxh3:0000000000000001", IDENTITY)
    assert await store.put(_blob(1001), 1, "xxh3:0000000000000001", IDENTITY) is None
    assert _count(registry, "refused") == 1
    assert kept is not None and store.take(kept.id) is kept  # nothing was evicted for it


async def test_leases_end_on_time_without_any_access(nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    store, registry = _store(ttl_s=30.0)
    await nursery.start(store.run)
    t0 = trio.current_time()
    first = await store.put(_blob(100), 1, "xxh3:0000000000000001", IDENTITY)
    await trio.sleep(10)
    second = await store.put(_blob(100), 1, "xxh3:0000000000000001", IDENTITY)
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
    export = await store.put(_blob(100), 1, "xxh3:0000000000000001", IDENTITY)
    assert export is not None
    await trio.sleep(1.0)
    assert store.take(export.id) is None


async def test_stopping_the_store_drops_every_export(autojump_clock: trio.abc.Clock) -> None:
    store, _ = _store()
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await store.put(_blob(100), 1, "xxh3:0000000000000001", IDENTITY)
        nursery.cancel_scope.cancel()
    assert len(store) == 0 and store.bytes_held == 0


def _held_in(folder: Path) -> int:
    """Bytes of export files in the shared-memory folder (the probe aside)."""
    return sum(
        p.stat().st_size for p in folder.iterdir() if p.name.startswith("hydra-kv-") and not p.name.endswith("-probe")
    )


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


async def test_handed_files_count_against_the_bound_until_unlinked(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Issue 28, 1.1: a puller that never unlinks the files handed to it (a hostile client,
    a decode engine failing between the reply and the mapping) cannot make the folder hold
    more than max_bytes, and nothing is left once the lease would have ended."""
    area = ShmArea.open(str(tmp_path))
    assert area is not None
    registry = CollectorRegistry()
    store = ExportStore(max_bytes=1000, ttl_s=30.0, registry=registry, shm=area)
    await nursery.start(store.run)
    for _ in range(25):
        export = await store.put(_blob(400), 1, "xxh3:0000000000000001", IDENTITY)
        assert export is not None and export.shm is not None
        assert store.take(export.id, hand_over=True) is export  # and never unlinked
        assert _held_in(tmp_path) <= 1000 and store.occupied() <= 1000
    assert registry.get_sample_value("hydra_kv_export_handed_bytes") == store.handed_bytes > 0
    # One the puller did unlink is no longer counted: room without removing the others.
    export = await store.put(_blob(400), 1, "xxh3:0000000000000001", IDENTITY)
    assert export is not None and export.shm is not None
    store.take(export.id, hand_over=True)
    export.shm.unlink()
    before = _names(tmp_path)
    assert await store.put(_blob(400), 1, "xxh3:0000000000000001", IDENTITY) is not None
    assert _held_in(tmp_path) <= 1000 and before - _names(tmp_path) == set()
    mock_clock.jump(31.0)  # past every lease: the run loop wakes for handed files too
    with trio.fail_after(5):
        while store.handed_bytes or len(store):
            await store.wait_changed()
    assert _held_in(tmp_path) == 0
    area.close()


async def test_a_shared_file_is_written_off_the_trio_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28, 1.10: posix_fallocate and the copy (gigabytes, for a long prompt) run on a
    worker thread; the event loop keeps serving meanwhile."""
    area = ShmArea.open(str(tmp_path))
    assert area is not None
    seen: list[threading.Thread] = []
    fallocate = os.posix_fallocate

    def spy(fd: int, offset: int, size: int) -> None:
        seen.append(threading.current_thread())
        fallocate(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", spy)
    shared = await area.create([b"ab", b"cd"])
    assert shared is not None and bytes(shared.mapping) == b"abcd"
    assert seen and seen[0] is not threading.main_thread()
    area.close()
