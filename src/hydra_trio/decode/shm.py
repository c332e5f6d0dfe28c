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
over TCP as before. Names carry the owning process id: whatever a crash left is removed by
the next start of an engine (``ShmArea.open``), and a decode engine that maps an export
unlinks it at once, so its pages live exactly as long as the mapping.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_PREFIX = "hydra-kv"
# uid, pid, the area (one per engine: a process may run several), 128 random bits
_NAME = re.compile(rf"^{_PREFIX}-(\d+)-(\d+)-[0-9a-f]{{8}}-[A-Za-z0-9_-]{{22}}$")
_PROBE = re.compile(rf"^{_PREFIX}-(\d+)-(\d+)-[0-9a-f]{{8}}-probe$")

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

    def __init__(self, folder: Path, tag: str, token: str) -> None:
        self.folder = folder
        self._tag = tag
        self.probe = folder / f"{tag}-probe"
        self.token = token

    @classmethod
    def open(cls, folder: str) -> ShmArea | None:
        """The area in ``folder`` (None, logged, when it cannot be used); first removes what
        engines of this user that no longer run left behind."""
        root = Path(folder)
        if not root.is_dir() or not os.access(root, os.W_OK):
            log.info("KV hand-offs over shared memory: off (%s is not a writable folder)", folder)
            return None
        _remove_stale(root)
        token = secrets.token_urlsafe(16)
        tag = f"{_PREFIX}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        probe = root / f"{tag}-probe"
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
        except OSError as exc:
            log.info("KV hand-offs over shared memory: off (cannot write in %s: %s)", folder, exc)
            return None
        return cls(root, tag, token)

    def advertised(self) -> dict[str, str]:
        """What kv_transfer_params tell a decode engine, to find out whether it shares the folder."""
        return {"probe": str(self.probe), "token": self.token}

    def create(self, parts: Sequence[Buffer]) -> ShmFile | None:
        """A new shared file holding ``parts`` back to back; None (logged) when the folder has
        no room (tmpfs is bounded): the export then stays in process memory."""
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
        with contextlib.suppress(FileNotFoundError):
            self.probe.unlink()
        for path in self.folder.glob(f"{self._tag}-*"):  # exports never pulled nor expired
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _remove_stale(root: Path) -> None:
    """Remove this user's hand-off files whose owning process is gone (a crash)."""
    uid = os.getuid()
    for path in root.glob(f"{_PREFIX}-{uid}-*"):
        m = _NAME.match(path.name) or _PROBE.match(path.name)
        if m is None or int(m.group(2)) == os.getpid() or _alive(int(m.group(2))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            log.info("removed %s, left by engine process %s", path, m.group(2))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shares_folder(advertised: object) -> bool:
    """Whether this process sees the prefill engine's shared-memory folder: its probe file
    is here, with the announced contents. The path comes from a request, so it is opened
    without following a link and without blocking (a FIFO would otherwise hang the caller),
    and only a regular file of this user's counts."""
    if not isinstance(advertised, dict):
        return False
    probe, token = advertised.get("probe"), advertised.get("token")
    if not isinstance(probe, str) or not isinstance(token, str) or not _PROBE.match(Path(probe).name):
        return False
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
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


def map_export(path: str, size: int, probe: str) -> mmap.mmap:
    """Map a pulled export privately (a restore may rewrite a few bytes in place: copy on
    write, the file is not changed) and unlink it: its pages now live as long as this
    mapping. OSError when it is not this user's export file of ``size`` bytes, in the
    folder of the ``probe`` that was checked."""
    p = Path(path)
    if not _NAME.match(p.name) or p.parent != Path(probe).parent:
        raise OSError(f"not a hand-off file: {path}")
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size or (st.st_mode & 0o077):
            raise OSError(f"{path}: owner, size or mode is not an export's")
        mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        p.unlink()
    return mapping
