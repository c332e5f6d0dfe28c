"""The tiers past the slots, as one: the host prompt cache (RAM, ``--cache-ram-mib``), the disk
tier that takes what RAM drops (``--cache-disk``), the one retention order both evict by,
their KV events (medium ``CPU`` and ``DISK``), and prefetch: a history on disk brought back
into RAM before the slot that restores it is there (``promote``: while its request waits for
a slot; ``want``: when a client says a session resumes, while its tool still runs), so that
its turn waits for a memory copy, not for a disk read or a prefill."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import trio

from ...config import Settings
from ...wire.kvevents import MEDIUM_DISK, MEDIUM_HOST, Event
from ..llama import LoraSet
from .blocks import HostBlocks, LoraFields, _no_adapters
from .disktier import DiskStats, DiskTier
from .promptcache import PromptCache
from .retention import KvOwner, Retention

GiB = 1 << 30
MIN_GAIN = 16  # a disk entry is brought to RAM when it holds this many positions more (a block)
MAX_WANTED = 64  # sessions waiting for a prefetch; past it a hint is dropped


class HostTiers:
    def __init__(self, settings: Settings, retention: Retention, fingerprint: bytes) -> None:
        self.retention = retention
        self.ram = PromptCache(settings.cache_ram_mib << 20, retention) if settings.cache_ram_mib > 0 else None
        self.disk: DiskTier | None = None
        if settings.cache_disk and self.ram is not None:
            self.disk = DiskTier(Path(settings.cache_disk), int(settings.cache_disk_gib * GiB), fingerprint, retention)
            self.ram.spill = self.disk.spill  # what RAM evicts for room goes to disk
        self.ram_blocks: HostBlocks | None = None
        self.disk_blocks: HostBlocks | None = None
        self._wanted_send, self._wanted = trio.open_memory_channel[KvOwner](MAX_WANTED)

    async def open(self) -> None:
        """Clean and index the disk tier's folder (before the engine serves)."""
        if self.disk is not None:
            await self.disk.open()

    async def run(self) -> None:
        """The disk tier's I/O task and the prefetch of wanted sessions, for the engine's life."""
        if self.disk is None:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.disk.run)
            async for owner in self._wanted:
                await self._promote_owned(owner)

    async def promote(self, prompt: Sequence[int], salt: str | None, lora: LoraSet = ()) -> bool:
        """Bring the disk entry that holds the most of ``prompt`` (under ``salt`` and the LoRA
        adapter set ``lora``) into RAM, when it holds a
        block more than RAM does (a request waits for a slot meanwhile). True: it is in RAM."""
        disk, ram = self.disk, self.ram
        if disk is None or ram is None:
            return False
        hit = disk.best(prompt, salt, lora)
        in_ram = ram.best(prompt, salt, lora)
        if hit is None or hit.n_common < (in_ram.n_common if in_ram else 0) + MIN_GAIN:
            return False
        owner = disk.owner_of(hit.key)
        snap = await disk.load(hit.key, salt, lora)
        if snap is None:
            return False
        disk.stats.prefetched += 1
        return ram.put(snap, owner)

    def want(self, owner: KvOwner) -> None:
        """A client said this session resumes soon: its newest history on disk comes to RAM
        (never waits; a full queue drops the hint)."""
        if self.disk is None or not self.disk.holds(owner):
            return
        try:
            self._wanted_send.send_nowait(owner)
        except trio.WouldBlock:
            pass

    async def _promote_owned(self, owner: KvOwner) -> None:
        disk, ram = self.disk, self.ram
        assert disk is not None and ram is not None
        key = disk.newest_of(owner)
        if key is None:
            return
        snap = await disk.load(key, owner.salt)
        if snap is not None:
            disk.stats.prefetched += 1
            ram.put(snap, owner)

    def watch(
        self, block_size: int, publish: Callable[[list[Event]], None], lora_fields: LoraFields | None = None
    ) -> None:
        """KV events from now on: RAM's entries as medium CPU, the disk's as DISK (each with
        its LoRA adapter set's fields, ``lora_fields``)."""
        fields = lora_fields or _no_adapters
        if self.ram is not None:
            self.ram_blocks = HostBlocks(block_size, publish, fields, medium=MEDIUM_HOST)
            self.ram.watch(self.ram_blocks)
        if self.disk is not None:
            self.disk_blocks = HostBlocks(block_size, publish, fields, medium=MEDIUM_DISK)
            self.disk.watch(self.disk_blocks)

    def publish_resync(self) -> None:
        for blocks in (self.ram_blocks, self.disk_blocks):
            if blocks is not None:
                blocks.publish_resync()

    def clear(self) -> None:
        """A CONFIGURE T2/T3 change: no state of the old context or model fits the new one."""
        if self.ram is not None:
            self.ram.clear()
        if self.disk is not None:
            self.disk.clear()

    def release(self, owners: set[KvOwner]) -> tuple[int, int]:
        """Drop these sessions' entries (their tree was finished): (RAM, disk) entries."""
        ram = self.ram.drop_owned(owners) if self.ram is not None else 0
        disk = self.disk.drop_owned(owners) if self.disk is not None else 0
        return ram, disk

    def refit(self, fingerprint: bytes) -> None:
        """The model or context a T2/T3 change left serving: what the disk tier writes now."""
        if self.disk is not None:
            self.disk.fingerprint = fingerprint

    def disk_stats(self) -> DiskStats | None:
        return None if self.disk is None else replace(self.disk.stats)
