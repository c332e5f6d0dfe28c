"""KV that RAM must drop, on disk (``--cache-disk DIR --cache-disk-gib N``): the third tier.

What the prompt cache evicts for room (promptcache.py ``spill``; not what a finished session
drops) is indexed here at once, like the prompt cache (the same ``PromptCache`` over
``DiskEntry`` records, so the same longest-prefix lookup, bound and retention order), and
written by one I/O task, off the trio thread; until its write is done an entry is served
from the memory it came from. A prompt that an entry here continues better than the slot or
RAM reads it back (``load``) and restores it as RAM's entries are.

Crash-safe: an entry is written to a temporary file, fsynced, renamed into place and the
folder fsynced, so a name that exists holds a whole entry; a header and a payload checksum
(xxh3) are checked before any byte is restored, so a torn or altered file is never read back
(it is deleted and counted). At start the folder is cleaned: temporary files (a write that a
crash cut), files that do not parse, entries of another model or KV layout, and what exceeds
the bound are removed; the rest is indexed again (their sessions unknown: one-off).

Salted keys only: a file's name is a keyed hash (the folder's own secret, ``.key``) of its
cache_salt and tokens, and the salt itself is kept only as such a hash, so neither names nor
headers tell a prompt or a tenant, and an entry serves only its own salt's requests.
Pure of llama_cpp: the engine restores what ``load`` returns.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import xxhash

from ..llama import LlamaBackend, LoraSet, Snapshot
from .promptcache import CacheHit, CacheWatcher, PromptCache
from .retention import KvOwner, Retention

log = logging.getLogger(__name__)

MAGIC = b"HYDRAKV\x01"
# magic, header bytes, fingerprint (32), n_tokens, room before the state, has_logits,
# salt key bytes, payload bytes, payload xxh3; then the header's own xxh3 over all before it.
_HEAD = struct.Struct("<8sI32sIIBHQQ")
_CHECK = struct.Struct("<Q")
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
MAX_PENDING = 64  # entries waiting to be written; past it an eviction is dropped (counted)


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """An entry as the index keeps it: what a lookup compares, and where its bytes are."""

    tokens: list[int]
    salt: str | None  # the keyed hash of the salt and the LoRA adapter set (None: neither)
    name: str
    nbytes: int  # the file's size
    adapters: LoraSet = ()  # the adapter set, when this process wrote it (for KV events)

    @property
    def lora(self) -> LoraSet:
        """The set is in the salt's hash: the index's runs are by that alone."""
        return ()

    @property
    def order(self) -> tuple[str, LoraSet, list[int]]:
        return (self.salt or "", (), self.tokens)


@dataclass(slots=True)
class DiskStats:
    nbytes: int = 0
    entries: int = 0
    written: int = 0  # entries written
    loaded: int = 0  # entries read back into a slot
    loaded_tokens: int = 0
    rejected: int = 0  # files that failed a check when read (never restored)
    dropped: int = 0  # evictions not written: the write queue was full
    cleaned: int = 0  # files removed at start (temporary, torn, foreign, over the bound)
    prefetched: int = 0  # entries brought back to RAM ahead of their turn (tiers.py)


class TornEntry(Exception):
    """A file that does not hold what its header says (never restored)."""


@dataclass(slots=True)
class DiskTier:
    folder: Path
    max_bytes: int
    fingerprint: bytes  # 32 bytes: the model and KV layout entries must match
    retention: Retention
    watcher: CacheWatcher | None = None  # medium DISK KV events (blocks.HostBlocks)
    pending_max_bytes: int = 256 << 20  # evicted bytes waiting to be written, at most
    stats: DiskStats = field(default_factory=DiskStats)
    _pending_bytes: int = 0
    _secret: bytes = b""
    _index: PromptCache = field(init=False)
    _names: dict[int, str] = field(default_factory=dict)  # index key -> file name
    _loading: set[int] = field(default_factory=set)  # taken for a read: not deleted on removal
    _doomed: list[str] = field(default_factory=list)  # files to delete (the I/O task's)
    _pending: dict[int, Snapshot] = field(default_factory=dict)  # index key -> not yet written
    _send: trio.MemorySendChannel[int] = field(init=False)
    _recv: trio.MemoryReceiveChannel[int] = field(init=False)
    _wake: trio.Event = field(default_factory=trio.Event)
    _writes: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    _reads: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(2))

    def __post_init__(self) -> None:
        self._index = PromptCache(self.max_bytes, self.retention, tier="disk", watcher=_Forget(self))
        self._send, self._recv = trio.open_memory_channel(MAX_PENDING)

    # ---- start, and the I/O task ---------------------------------------------------------

    async def open(self) -> None:
        """Make the folder (0700), read its secret, clean it, index what is whole."""
        self._secret = await trio.to_thread.run_sync(self._prepare_folder, limiter=self._writes)
        found, cleaned = await trio.to_thread.run_sync(self._scan, limiter=self._writes)
        self.stats.cleaned += cleaned
        for entry in found:
            if not self._index.put(entry, None):  # over the bound: its file goes
                self._doomed.append(entry.name)
        self._sync_stats()
        log.info("disk tier %s: %d entries (%d "
                 "bytes) kept, %d files cleaned", self.folder, len(self._index), self._index.nbytes, cleaned)

    async def run(self) -> None:
        """The one I/O task: write what RAM dropped, delete what left the index."""
        while True:
            await self._delete_doomed()
            try:
                key = self._recv.receive_nowait()
            except trio.WouldBlock:
                await self._wake.wait()
                self._wake = trio.Event()  # re-armed, then the queue looked at again
                continue
            snap = self._pending.get(key)
            if snap is not None:  # else taken or evicted before its turn: nothing to write
                await self._write(key, snap)

    def spill(self, snap: Snapshot, owner: KvOwner | None) -> None:
        """The prompt cache evicted this for room: index it now, write it soon (never waits;
        a full write queue drops it, counted)."""
        if self._pending_bytes + snap.nbytes > self.pending_max_bytes:
            self.stats.dropped += 1
            return
        salt_key = self.salt_key(snap.salt, snap.lora)
        size = _HEAD.size + _CHECK.size + len(salt_key or "") + 4 * len(snap.tokens) + len(snap.buf) - snap.offset
        entry = DiskEntry(snap.tokens, salt_key, self._fresh_name(snap.tokens, salt_key), size, snap.lora)
        if not self._index.put(entry, owner):
            self.stats.dropped += 1
            return
        key = self._index.newest_key()
        try:
            self._send.send_nowait(key)
        except trio.WouldBlock:
            self.stats.dropped += 1
            self._index.drop(key)
            return
        self._pending[key] = snap
        self._pending_bytes += snap.nbytes
        self._wake.set()
        self._sync_stats()

    def watch(self, watcher: CacheWatcher) -> None:
        """Tell ``watcher`` (medium DISK events) every entry held now, and each change."""
        self.watcher = watcher
        for key, entry in self._index.items():
            watcher.entry_stored(key, entry.tokens, entry.salt, entry.adapters)

    # ---- lookups ---------------------------------------------------------------------------

    def salt_key(self, salt: str | None, lora: LoraSet = ()) -> str | None:
        """How a salt and a LoRA adapter set are written here: a keyed hash (so no file tells a
        tenant's salt); the set's adapters are the fingerprint's (``kv_fingerprint``)."""
        if salt is None and not lora:
            return None
        key = (salt or "").encode("utf-8", "surrogatepass")
        if lora:
            key = b"cache_salt\0" + key + b"\0lora\0" + repr(tuple(lora)).encode()
        return hashlib.blake2b(key, key=self._secret, digest_size=16).hexdigest()

    def best(self, prompt: Sequence[int], salt: str | None, lora: LoraSet = ()) -> CacheHit | None:
        return self._index.best(prompt, self.salt_key(salt, lora))

    async def load(self, key: int, salt: str | None, lora: LoraSet | None = None) -> Snapshot | None:
        """Take an entry out and read it back, checked (None: it failed a check and is gone);
        the snapshot is ``salt``'s and ``lora``'s, what it was looked up under (``lora`` None:
        the set this process wrote it under). One not written yet comes from the memory it
        was to be written from."""
        entry = self._index._entries[key]
        if lora is None:
            lora = entry.adapters
        waiting = self._pending.get(key)
        if waiting is not None:
            self._index.take(key)  # (its write is skipped: _removed)
            self.stats.loaded += 1
            self.stats.loaded_tokens += len(waiting.tokens)
            self._sync_stats()
            return Snapshot(waiting.tokens, waiting.buf, waiting.offset, waiting.has_logits, salt, lora)
        self._loading.add(key)
        try:
            self._index.take(key)
            snap = await trio.to_thread.run_sync(self._read, entry, limiter=self._reads)
        except (OSError, TornEntry) as exc:
            self.stats.rejected += 1
            log.warning("disk tier: entry %s not restored (%s): removed", entry.name, exc)
            return None
        finally:
            self._loading.discard(key)
            self._doomed.append(entry.name)  # read (or not): the slot holds it now
            self._wake.set()
            self._sync_stats()
        self.stats.loaded += 1
        self.stats.loaded_tokens += len(snap.tokens)
        return Snapshot(snap.tokens, snap.buf, snap.offset, snap.has_logits, salt, lora)

    def owner_of(self, key: int) -> KvOwner | None:
        return self._index.owner_of(key)

    def holds(self, owner: KvOwner) -> bool:
        return owner in self._index._by_owner

    def newest_of(self, owner: KvOwner) -> int | None:
        """The key of the owner's newest entry here (None: it has none)."""
        keys = self._index._by_owner.get(owner)
        return next(reversed(keys)) if keys else None

    def drop_owned(self, owners: set[Any]) -> int:
        n = self._index.drop_owned(owners)
        self._wake.set()
        self._sync_stats()
        return n

    def clear(self, fingerprint: bytes | None = None) -> None:
        """Drop every entry (the context or model changed); ``fingerprint``: the new one's."""
        for name in self._names.values():
            self._doomed.append(name)
        self._names.clear()
        self._index.clear()
        while True:  # what waits to be written is of the old context too
            try:
                self._recv.receive_nowait()
            except trio.WouldBlock:
                break
        self._pending.clear()
        self._pending_bytes = 0
        if fingerprint is not None:
            self.fingerprint = fingerprint
        self._wake.set()
        self._sync_stats()

    def items(self) -> list[tuple[int, DiskEntry]]:
        return list(self._index.items())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._index)

    # ---- the files -------------------------------------------------------------------------

    def _name(self, tokens: Sequence[int], salt_key: str | None) -> str:
        """The keyed hash of what an entry holds (its file name's first part)."""
        h = hashlib.blake2b(key=self._secret, digest_size=16)
        h.update((salt_key or "").encode() + b"\0")
        h.update(array("i", tokens).tobytes())
        return h.hexdigest()

    def _fresh_name(self, tokens: Sequence[int], salt_key: str | None) -> str:
        """A file name of its own for every write: the deletion of an older copy of the same
        history (queued meanwhile) can never remove this one."""
        return f"{self._name(tokens, salt_key)}-{secrets.token_hex(4)}{SUFFIX}"

    async def _write(self, key: int, snap: Snapshot) -> None:
        entry: DiskEntry = self._index._entries[key]  # type: ignore[assignment]
        try:
            await trio.to_thread.run_sync(self._write_file, snap, entry.salt, entry.name, limiter=self._writes)
        except OSError as exc:
            log.warning("disk tier: entry of %d positions not written: %s", len(snap.tokens), exc)
            if self._pending.pop(key, None) is not None:
                self._pending_bytes -= snap.nbytes
                self._index.drop(key)
            self._sync_stats()
            return
        self.stats.written += 1
        if self._pending.pop(key, None) is None:  # taken or evicted while it was written
            self._doomed.append(entry.name)
        else:
            self._pending_bytes -= snap.nbytes
        self._sync_stats()

    def _write_file(self, snap: Snapshot, salt_key: str | None, name: str) -> int:
        """Write, fsync, rename, fsync the folder: a name that exists holds a whole entry."""
        payload = memoryview(snap.buf)[snap.offset :]
        tokens = array("i", snap.tokens).tobytes()
        salt = (salt_key or "").encode()
        head = _HEAD.pack(
            MAGIC, _HEAD.size + _CHECK.size + len(salt) + len(tokens), self.fingerprint, len(snap.tokens),
            snap.offset, snap.has_logits, len(salt), len(payload), xxhash.xxh3_64_intdigest(payload),
        )
        head += _CHECK.pack(xxhash.xxh3_64_intdigest(head))
        tmp = self.folder / f"{TMP_PREFIX}{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for part in (head, salt, tokens, payload):
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, self.folder / name)
        self._fsync_folder()
        return len(head) + len(salt) + len(tokens) + len(payload)

    def _fsync_folder(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_head(self, f: Any, size: int) -> tuple[tuple[Any, ...], str | None, list[int]]:
        raw = f.read(_HEAD.size + _CHECK.size)
        if len(raw) != _HEAD.size + _CHECK.size or raw[:8] != MAGIC:
            raise TornEntry("no entry header")
        head = _HEAD.unpack(raw[: _HEAD.size])
        if _CHECK.unpack(raw[_HEAD.size :])[0] != xxhash.xxh3_64_intdigest(raw[: _HEAD.size]):
            raise TornEntry("header checksum")
        _, head_bytes, fingerprint, n_tokens, _, _, salt_len, payload_len, _ = head
        if fingerprint != self.fingerprint:
            raise TornEntry("another model or KV layout")
        if head_bytes != _HEAD.size + _CHECK.size + salt_len + 4 * n_tokens or size != head_bytes + payload_len:
            raise TornEntry(f"size {size}, the header says {head_bytes + payload_len}")
        try:
            salt = f.read(salt_len).decode() or None
        except UnicodeDecodeError:
            raise TornEntry("salt key") from None
        tokens = array("i")
        tokens.frombytes(f.read(4 * n_tokens))
        return head, salt, tokens.tolist()

    def _read(self, entry: DiskEntry) -> Snapshot:
        path = self.folder / entry.name
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head, salt, tokens = self._read_head(f, size)
            _, _, _, _, offset, has_logits, _, payload_len, checksum = head
            if tokens != entry.tokens or salt != entry.salt:
                raise TornEntry("not the entry indexed under this name")
            buf = bytearray(offset + payload_len)
            view = memoryview(buf)[offset:]
            while view:
                n = f.readinto(view)
                if not n:
                    raise TornEntry("short payload")
                view = view[n:]
        if xxhash.xxh3_64_intdigest(memoryview(buf)[offset:]) != checksum:
            raise TornEntry("payload checksum")
        return Snapshot(tokens, buf, offset, bool(has_logits), None)

    def _prepare_folder(self) -> bytes:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.folder / ".key"
        try:
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            secret = key.read_bytes()
            if len(secret) == 32:
                return secret
            key.unlink()  # torn: a new secret, and no old name is found again (cleaned below)
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        secret = secrets.token_bytes(32)
        try:
            os.write(fd, secret)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._fsync_folder()
        return secret

    def _scan(self) -> tuple[list[DiskEntry], int]:
        """What the folder holds that is whole and ours, oldest first; removes the rest."""
        found: list[tuple[float, DiskEntry]] = []
        cleaned = 0
        for path in self.folder.iterdir():
            name = path.name
            if not (name.startswith(TMP_PREFIX) or name.endswith(SUFFIX)) or not path.is_file() or path.is_symlink():
                continue  # not ours: left alone
            try:
                if name.startswith(TMP_PREFIX):
                    raise TornEntry("a write that did not finish")
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    _, salt, tokens = self._read_head(f, st.st_size)
                if name.split("-")[0] != self._name(tokens, salt):
                    raise TornEntry("another folder secret's")
                found.append((st.st_mtime, DiskEntry(tokens, salt, name, st.st_size)))
            except (OSError, TornEntry) as exc:
                log.info("disk tier: removing %s at start (%s)", name, exc)
                path.unlink(missing_ok=True)
                cleaned += 1
        return [e for _, e in sorted(found, key=lambda f: f[0])], cleaned

    async def _delete_doomed(self) -> None:
        while self._doomed:
            doomed, self._doomed = self._doomed, []

            def delete(names: list[str] = doomed) -> None:
                for name in names:
                    (self.folder / name).unlink(missing_ok=True)

            await trio.to_thread.run_sync(delete, limiter=self._writes)

    def _removed(self, key: int) -> None:
        name = self._names.pop(key, None)
        waiting = self._pending.pop(key, None)
        if waiting is not None:  # never written (or being written: _write deletes it after)
            self._pending_bytes -= waiting.nbytes
            return
        if name is not None and key not in self._loading:
            self._doomed.append(name)
            self._wake.set()

    def _sync_stats(self) -> None:
        self.stats.nbytes, self.stats.entries = self._index.nbytes, len(self._index)


@dataclass(slots=True)
class _Forget:
    """The index's watcher: a file follows its entry out, and medium DISK events are told."""

    tier: DiskTier

    def entry_stored(
        self, key: int, tokens: Sequence[int], salt: str | None, lora: LoraSet = (), session_id: str | None = None
    ) -> None:
        entry = self.tier._index._entries[key]
        self.tier._names[key] = entry.name  # type: ignore[attr-defined]
        if self.tier.watcher is not None:
            self.tier.watcher.entry_stored(key, tokens, salt, entry.adapters, session_id)

    def entry_removed(self, key: int) -> None:
        self.tier._removed(key)
        if self.tier.watcher is not None:
            self.tier.watcher.entry_removed(key)

    def cleared(self) -> None:
        if self.tier.watcher is not None:
            self.tier.watcher.cleared()


def kv_fingerprint(backend: LlamaBackend, identity: dict[str, Any]) -> bytes:
    """32 bytes naming the model (its identity, ``model_hash`` among it once computed, and its
    file's size and time), the LoRA adapters loaded with it (their paths, in the order a set's
    indices name them) and the KV layout a saved state was made in: entries of any other are
    not read back."""
    st = os.stat(backend.model_path)
    b = backend
    parts: tuple[Any, ...] = (
        identity,
        st.st_size,
        st.st_mtime_ns,
        b.cache_layout,
        b.n_slots,
        b.n_ctx,
        b.kv_unified,
        b.swa_full,
    )
    adapters = tuple(getattr(b, "lora_paths", ()))
    if adapters:
        parts += (adapters,)
    return hashlib.sha256(repr(parts).encode()).digest()

