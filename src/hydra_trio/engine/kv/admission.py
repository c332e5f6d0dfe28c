"""The one admission of KV that comes from elsewhere (DECODE, STATE_PUT, a P/D pull): its
bytes parsed as a blob no longer than a slot holds (off the trio thread when large), the
identity gate on what its sender claims of the model that made it (spec §4.2), and the
K/V cache layout it was made with. Each caller decides what a refusal means for it (a
CAP_MISMATCH reply, a hand-off's fall-back); a malformed blob is always BAD_FRAME."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ...concurrency import run_cpu_bound
from ...model.identity import IdentityMatch, ModelIdentity, compare_identity
from ...wire.kvblob import KvBlob, parse_kv_blob
from ..llama import cache_layout_mismatch


@dataclass(frozen=True, slots=True)
class Admitted:
    blob: KvBlob | None  # the parsed blob (None: no bytes were given)
    match: IdentityMatch | None  # the identity gate's verdict (None: no claims were given)
    layout_problem: str | None = None  # the claimed K/V cache layout differs from ours: why

    @property
    def accepted(self) -> bool:
        return (self.match is None or self.match.accepted) and self.layout_problem is None


async def admit_blob(
    raw: memoryview | bytes | None,
    claims: Mapping[str, Any] | None,
    *,
    resident: ModelIdentity,
    kv_cache_layout: Mapping[str, Any],
    max_tokens: int,
    header_model: str | None = None,
    lora: Sequence[Mapping[str, Any]] | None = None,
) -> Admitted:
    """``raw`` parsed (BAD_FRAME when malformed; at most ``max_tokens`` positions, checked
    before the token list is built) and ``claims`` (identity fields, and ``kv_cache`` when the
    sender says how its cache is laid out) held against the ``resident`` model and this
    engine's ``kv_cache_layout``. ``header_model``: the model a DECODE header names; ``lora``:
    the LoRA adapter set the KV must have been made under (the request's; None: unchecked)."""
    blob = None
    if raw is not None:
        blob = await run_cpu_bound(partial(parse_kv_blob, raw, max_tokens=max_tokens), len(raw))
    match = problem = None
    if claims is not None:
        match = compare_identity(resident, claims, header_model=header_model, lora=lora)
        layout = claims.get("kv_cache") if isinstance(claims, Mapping) else None
        if isinstance(layout, Mapping):
            problem = cache_layout_mismatch(dict(layout), dict(kv_cache_layout))
    return Admitted(blob, match, problem)
