"""Same-host hand-off through shared memory: a KV export lives in a file of ``/dev/shm``
(tmpfs), and a decode engine on the same host maps it instead of receiving it over TCP.

Why a ``/dev/shm`` file and not a memfd passed over a Unix socket: the hand-off already has
its connection, the KV_PULL over TCP (with its allowlist, identity, hash and lease checks),
and a file name travels in its reply as it is; a memfd would need a second, Unix-socket
listener serving the RPC protocol just to pass a descriptor. The file is 0600 (only this
user's processes can open it) and its name holds 128 random bits, a capability that only the
KV_PULL reply tells.

Nothing is assumed: a prefill engine keeps a small probe file whose name and contents its
``kv_transfer_params`` announce, and a decode engine asks for the shared-memory form only
when it can read that probe (containers may not share ``/dev/shm``); otherwise the bytes go
over TCP as before. A decode engine that maps an export unlinks it at once, so its pages
live exactly as long as the mapping; one whose pull fails after the reply unlinks it too.

Liveness is a lock, not a process id: the owning engine holds an ``flock`` on its probe
file for as long as it runs (the kernel drops it when the process dies, however it dies).
The next start of any engine (``ShmArea.open``) removes this user's files whose probe is
unlocked or gone: what a crash left. A process id would be wrong across PID namespaces
(two containers sharing ``/dev/shm`` see each other's ids as other processes, or none).
The names still carry the pid, for a person reading the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

log = logging.getLogger(__name__)

_PREFIX = "hydra-kv"
# The tag (uid, pid, the area: one per engine, a process may run several), then 128 random
# bits (an export) or "probe".
_TAG = rf"{_PREFIX}-\d+-\d+-[0-9a-f]{{8}}"
_NAME = re.compile(rf"^({_TAG})-[A-Za-z0-9_-]{{22}}$")
_PROBE = re.compile(rf"^({_TAG})-probe$")

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class ShmFile:
    """One export's bytes in a shared file, mapped here."""

    path: Path
    mapping: mmap.mmap

    def views(self, sizes: Sequence[int]) -> list[memoryview]:
        out, off = [], 0
        view = memoryview(self.mapping)
        for n in sizes:
            out.append(view[off : off + n])
            off += n
        return out

    def unlink(self) -> None:
        """Drop the name (the pages stay while a mapping holds them)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class ShmArea:
    """This engine's files in the shared-memory folder: exports and the probe."""

    def __init__(self, folder: Path, tag: str, token: str, lock_fd: int) -> None:
        self.folder = folder
        self._tag = tag
        self.probe = folder / f"{tag}-probe"
        self.token = token
        self._lock_fd = lock_fd  # the probe, open and flock'ed while this engine runs
        # Copies into a new file run on threads of their own: a plain file copy is not a
        # llama.cpp call (those go through the one GPU worker), and its own limiter keeps
        # exports from taking the threads other to_thread work waits for.
        self._copy_limiter = trio.CapacityLimiter(2)

    @classmethod
    def open(cls, folder: str) -> ShmArea | None:
        """The area in ``folder`` (None, logged, when it cannot be used); first removes what
        engines of this user that no longer run left behind."""
        root = Path(folder)
        if not root.is_dir() or not os.access(root, os.W_OK):
            log.info("KV hand-offs over shared memory: off (%s is not a writable folder)", folder)
            return None
        remove_stale(root)
        token = secrets.token_urlsafe(16)
        tag = f"{_PREFIX}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = _locked_probe(root, tag, token)
        except OSError as exc:
            log.info("KV hand-offs over shared memory: off (cannot write in %s: %s)", folder, exc)
            return None
        return cls(root, tag, token, fd)

    def advertised(self) -> dict[str, str]:
        """What kv_transfer_params tell a decode engine, to find out whether it shares the
        folder, and which network namespace this engine is in (see ``shares_folder``)."""
        out = {"probe": str(self.probe), "token": self.token}
        if (netns := network_namespace()) is not None:
            out["netns"] = netns
        return out

    async def create(self, parts: Sequence[Buffer]) -> ShmFile | None:
        """A new shared file holding ``parts`` back to back; None (logged) when the folder has
        no room (tmpfs is bounded): the export then stays in process memory. The allocation
        and the copy (up to gigabytes) run on a thread, not the trio thread; once started
        they finish (not abandoned on cancel: no half-made file is left behind)."""
        return await trio.to_thread.run_sync(self._create, parts, limiter=self._copy_limiter)

    def _create(self, parts: Sequence[Buffer]) -> ShmFile | None:
        size = sum(len(p) for p in parts)
        path = self.folder / f"{self._tag}-{secrets.token_urlsafe(16)}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            log.warning("KV export kept in process memory: cannot create %s: %s", path, exc)
            return None
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not a SIGBUS while copying
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            path.unlink()
            log.warning("KV export kept in process memory: no room in %s for %d bytes: %s", self.folder, size, exc)
            return None
        os.close(fd)  # the mapping keeps the file open
        off = 0
        for p in parts:
            mapping[off : off + len(p)] = p
            off += len(p)
        return ShmFile(path, mapping)

    def close(self) -> None:
        for path in self.folder.glob(f"{self._tag}-*"):  # exports never pulled nor expired
            if path != self.probe:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        with contextlib.suppress(FileNotFoundError):
            self.probe.unlink()
        if self._lock_fd >= 0:  # the lock goes last: until then, this area is alive to others
            os.close(self._lock_fd)
            self._lock_fd = -1


def _locked_probe(root: Path, tag: str, token: str) -> int:
    """This area's probe, written and locked under a name no clean-up matches, then renamed
    into place: no other engine ever sees it unlocked. Returns the descriptor holding the lock."""
    tmp, probe = root / f".{tag}-probe", root / f"{tag}-probe"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, token.encode())
        os.rename(tmp, probe)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return fd


def remove_stale(root: Path) -> None:
    """Remove this user's hand-off files whose owning engine is gone (a crash). Never raises:
    anything in the folder (a planted name, another user's file, a link) is skipped, and a
    file that cannot be examined or removed is logged and left."""
    uid = os.getuid()
    try:
        paths = list(root.glob(f"{_PREFIX}-{uid}-*"))
    except OSError as exc:
        log.warning("KV shared memory: cannot list %s for stale files: %s", root, exc)
        return
    alive: dict[str, bool] = {}  # tag -> its owner holds its probe's lock
    for path in paths:
        try:
            _remove_if_stale(path, uid, alive)
        except (OSError, ValueError, OverflowError) as exc:
            log.warning("KV shared memory: left %s (cannot check or remove it: %s)", path, exc)


def _remove_if_stale(path: Path, uid: int, alive: dict[str, bool]) -> None:
    m = _NAME.match(path.name) or _PROBE.match(path.name)
    if m is None:
        return
    st = os.lstat(path)  # the name itself: a link is never followed
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
        return  # a link, a folder, or another user's file under our name: not ours to remove
    tag = m.group(1)
    if tag not in alive:
        alive[tag] = _owner_alive(path.parent / f"{tag}-probe", uid)
    if alive[tag]:
        return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        log.info("removed %s, left by an engine that no longer runs", path)


def _owner_alive(probe: Path, uid: int) -> bool:
    """Whether an engine holds the lock on ``probe``. No probe: its owner is gone (an engine
    makes its probe before any export file and removes it last). When it cannot be told (a
    folder without locks, a probe that is not this user's regular file): alive, kept."""
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held by its engine; others: cannot tell
            return True
        return False  # nobody holds it (ours is dropped as the descriptor closes)
    finally:
        os.close(fd)


def network_namespace() -> str | None:
    """This process's network namespace as ``"dev:inode"`` of /proc/self/ns/net (None where
    /proc does not tell it)."""
    try:
        st = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def shares_folder(advertised: object) -> bool:
    """Whether this process sees the prefill engine's shared-memory folder: its probe file
    is here, with the announced contents, and the prefill engine is in this network
    namespace. Engines in two namespaces are two hosts to the fleet (their own addresses,
    links that can be cut), even when a mount of /dev/shm is shared, as ``ip netns exec``
    leaves it: their hand-offs go over TCP. The path comes from a request, so it is opened
    without following a link and without blocking (a FIFO would otherwise hang the caller),
    and only a regular file of this user's counts."""
    if not isinstance(advertised, dict):
        return False
    theirs = advertised.get("netns")
    if theirs is not None and theirs != network_namespace():
        return False
    probe, token = advertised.get("probe"), advertised.get("token")
    if not isinstance(probe, str) or not isinstance(token, str) or not _PROBE.match(Path(probe).name):
        return False
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        return secrets.compare_digest(os.read(fd, 64), token.encode())
    except OSError:
        return False
    finally:
        os.close(fd)


def _export_file(path: str, probe: str) -> Path:
    """``path`` when it names an export file in the folder of the ``probe`` that was
    checked; OSError otherwise (the reply that names it is a peer's)."""
    if "\0" in path or "\0" in probe:
        raise OSError("not a hand-off file: a NUL in the name")
    p = Path(path)
    if not _NAME.match(p.name) or p.parent != Path(probe).parent:
        raise OSError(f"not a hand-off file: {path!r}")
    return p


def map_export(path: str, size: int, probe: str) -> mmap.mmap:
    """Map a pulled export privately (a restore may rewrite a few bytes in place: copy on
    write, the file is not changed) and unlink it: its pages now live as long as this
    mapping. OSError when it is not this user's export file of ``size`` bytes, in the
    folder of the ``probe`` that was checked; the size is compared before anything is
    mapped. On failure the file is left: the caller removes it (``discard_export``)."""
    p = _export_file(path, probe)
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or (st.st_mode & 0o077):
            raise OSError(f"{path}: owner or mode is not an export's")
        if st.st_size != size:
            raise OSError(f"{path}: {st.st_size} bytes; the export has {size}")
        mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        p.unlink()
    return mapping


def discard_export(path: object, probe: str) -> None:
    """Unlink a handed-over export file whose pull failed after the reply (any failure,
    a cancellation too): the prefill engine counts it against its bound until then. Only
    this user's regular export file in the probe's folder is touched; never raises."""
    if not isinstance(path, str):
        return
    try:
        p = _export_file(path, probe)
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            p.unlink()
    except OSError:
        pass
