"""The model file a load reads (at start, and for a CONFIGURE T3 reload): its identity from
the GGUF metadata, and ``model_hash``, the SHA-256 of its bytes, computed once per load.

Hashing a multi-GB file takes seconds to minutes (hashlib's SHA-256 ran at 0.33-0.55 GB/s on
the project's shared 2-core machine), so it runs in a thread of its own under its own limiter: never on the trio
thread (every connection and stream keeps going), never on the GPU worker (llama.cpp calls
keep going), and never in the thread pool's shared capacity. It stops at the next 8 MiB chunk
when its caller is cancelled.
"""

from __future__ import annotations

import logging
import time

import trio
from trio.lowlevel import RunVar

from ..model.identity import ModelIdentity, file_sha256, read_identity

log = logging.getLogger(__name__)

# One file hashed at a time per trio run (a load, or a reload: never both).
_HASHING: RunVar[trio.CapacityLimiter] = RunVar("hydra_model_hash_limiter")


def _limiter() -> trio.CapacityLimiter:
    try:
        return _HASHING.get()
    except LookupError:
        limiter = trio.CapacityLimiter(1)
        _HASHING.set(limiter)
        return limiter


async def read_model_identity(path: str, *, alias: str | None) -> ModelIdentity:
    """The identity of the GGUF at ``path`` (spec §5, ``alias``: --alias) with its
    ``model_hash``. OSError or ValueError when the file cannot be read as a GGUF."""

    def read() -> ModelIdentity:
        identity = read_identity(path, alias=alias)
        t0 = time.perf_counter()
        model_hash = file_sha256(path, between_chunks=trio.from_thread.check_cancelled)
        log.info("model file %s hashed in %.0f ms: sha256 %s", path, (time.perf_counter() - t0) * 1000.0, model_hash)
        return identity.with_hash(model_hash)

    return await trio.to_thread.run_sync(read, limiter=_limiter())
