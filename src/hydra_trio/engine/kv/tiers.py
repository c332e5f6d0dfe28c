"""The tiers past the slots, as one: the host prompt cache (RAM, ``--cache-ram-mib``), the disk
tier that takes what RAM drops (``--cache-disk``), the one retention order both evict by, and
their KV events (medium ``CPU`` and ``DISK``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ...config import Settings
from ...wire.kvevents import MEDIUM_DISK, MEDIUM_HOST, Event
from .blocks import HostBlocks
from .disktier import DiskStats, DiskTier
from .promptcache import PromptCache
from .retention import KvOwner, Retention

GiB = 1 << 30


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

    async def open(self) -> None:
        """Clean and index the disk tier's folder (before the engine serves)."""
        if self.disk is not None:
            await self.disk.open()

    async def run(self) -> None:
        """The disk tier's I/O task, for the engine's life."""
        if self.disk is not None:
            await self.disk.run()

    def watch(self, block_size: int, publish: Callable[[list[Event]], None]) -> None:
        """KV events from now on: RAM's entries as medium CPU, the disk's as DISK."""
        if self.ram is not None:
            self.ram_blocks = HostBlocks(block_size, publish, MEDIUM_HOST)
            self.ram.watch(self.ram_blocks)
        if self.disk is not None:
            self.disk_blocks = HostBlocks(block_size, publish, MEDIUM_DISK)
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
