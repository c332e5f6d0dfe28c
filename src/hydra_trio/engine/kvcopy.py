"""A slot's KV copied out as a v2 blob's parts, and the blob's hash tag: what STATE_GET,
PREFILL and a P/D export send (Engine.copy_out makes every one of them)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..tasks import run_cpu_bound
from ..wire.hashing import Buffer, xxh3_tag_of


@dataclass(slots=True)
class KvCopy:
    parts: list[Buffer]  # head, llama state (, the last position's logits)
    n_past: int
    state_size: int  # llama state bytes

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)

    async def kv_hash(self) -> str:
        """The blob's tag, hashed off the trio thread when it is large."""
        return await run_cpu_bound(partial(xxh3_tag_of, self.parts), self.size)
