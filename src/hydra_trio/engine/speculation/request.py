"""Whether and how a request speculates: the server's ``--spec-*`` settings, then the
request's own ``speculative`` keys (``SpecRequest``), as one ``SpecConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .drafter import NgramMemory, SpecConfig, SpecCounts, Speculation

if TYPE_CHECKING:
    from ...config import Settings

@dataclass(frozen=True, slots=True)
class SpecRequest:
    """A request's ``speculative`` keys (None: the server's setting)."""

    type: str | None = None
    n_max: int | None = None
    n_min: int | None = None


def spec_config(
    *,
    server_type: str,
    n_max: int,
    n_min: int,
    ngram_max: int,
    ngram_min: int,
    max_batch: int,
    request: SpecRequest | None,
    can_roll_back: bool,
) -> SpecConfig | None:
    """The one rule of whether and how a request speculates: the request's keys beat the
    server's; a model whose KV cannot drop positions (recurrent, hybrid) never does (the
    server refuses --spec-type at start; a request asking is served without)."""
    req = request or SpecRequest()
    kind = req.type if req.type is not None else server_type
    if kind == "none" or not can_roll_back:
        return None
    n_max = req.n_max if req.n_max is not None else n_max
    n_min = req.n_min if req.n_min is not None else n_min
    if n_max < 1:
        return None
    return SpecConfig(
        n_max=n_max, n_min=min(n_min, n_max), ngram_max=ngram_max, ngram_min=ngram_min, max_batch=max_batch
    )


def request_speculation(
    settings: Settings, request: SpecRequest | None, can_roll_back: bool, totals: SpecCounts, memory: NgramMemory
) -> Speculation | None:
    """A request's drafting under the server's ``--spec-*`` settings (``spec_config``), or
    None; its verified drafts also count into ``totals`` (the engine's), and its tokens go
    into ``memory`` (its salt's) and are drafted from there too."""
    config = spec_config(
        server_type=settings.spec_type,
        n_max=settings.spec_draft_n_max,
        n_min=settings.spec_draft_n_min,
        ngram_max=settings.spec_ngram_size_n,
        ngram_min=settings.spec_ngram_min_n,
        max_batch=settings.spec_max_batch,
        request=request,
        can_roll_back=can_roll_back,
    )
    return None if config is None else Speculation(config, totals, memory)
