"""LoRA adapters: the ones loaded with the model (``--lora``, ``--lora-scaled``) and their
default scales (llama-server's ``GET``/``POST /lora-adapters``), which adapter set a request
runs under (its ``lora`` list, llama-server's; or the adapter its ``model`` names, vLLM's),
how a set is named where it leaves the engine (KV events, hand-offs, DECODE's identity
gate: by name, scale and the file's digest, so ids may differ between engines), and which
adapters requests use (vLLM's ``vllm:lora_requests_info``).

The set a request runs under is also what its KV is computed under: with the cache_salt it
decides which slot KV and prompt-cache entries the request may continue (``LoraSet``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import trio

from ..model.identity import ModelIdentity
from ..model.lora import AdapterMeta, AdapterSpec, read_adapter
from ..wire.errors import ParamError, Status, bad_param
from .llama import LoraSet
from .params import GenerationParams

MAX_LORA_SCALE = 100.0  # |scale|: llama.cpp takes any float; past this it is a typo, not a blend


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    id: int  # its place among the loaded adapters (llama-server's id)
    spec: AdapterSpec
    meta: AdapterMeta


class LoraAdapters:
    """The loaded adapters, their default scales, and the sets requests choose."""

    def __init__(self, adapters: Sequence[LoadedAdapter] = ()) -> None:
        self.adapters = tuple(adapters)
        self._by_name = {a.spec.name: a for a in self.adapters}
        self.scales = [a.spec.scale for a in self.adapters]  # the default set (POST /lora-adapters)
        self._running: Counter[int] = Counter()  # adapter id -> requests holding a slot under it
        self._waiting: Counter[int] = Counter()  # ... waiting for one

    @classmethod
    async def read(cls, specs: Sequence[AdapterSpec]) -> LoraAdapters:
        """Each adapter file's metadata and digest, read off the trio thread."""
        metas = [await trio.to_thread.run_sync(read_adapter, s.path) for s in specs]
        return cls([LoadedAdapter(i, s, m) for i, (s, m) in enumerate(zip(specs, metas, strict=True))])

    def __len__(self) -> int:
        return len(self.adapters)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(a.spec.path for a in self.adapters)

    @property
    def names(self) -> list[str]:
        return [a.spec.name for a in self.adapters]

    # ---- the default set (llama-server's global scales) ----------------------------------

    def listing(self) -> list[dict[str, Any]]:
        """``GET /lora-adapters``: llama-server's entries (id, path, scale, task_name,
        prompt_prefix), and ours: the name a request's ``model`` selects it by, its digest."""
        return [
            {
                "id": a.id, "path": a.spec.path, "scale": self.scales[a.id], "task_name": a.meta.task_name,
                "prompt_prefix": a.meta.prompt_prefix, "name": a.spec.name, "digest": a.meta.digest,
            }
            for a in self.adapters
        ]

    def set_scales(self, body: Any) -> None:
        """``POST /lora-adapters``: ``[{"id", "scale"}, ...]`` becomes the default set, and an
        adapter not listed gets scale 0 (llama-server's ``construct_lora_list``). What runs
        keeps the set it started with; the next requests without ``lora`` get this one."""
        chosen = dict(self._parse(body, "the body"))
        self.scales = [chosen.get(a.id, 0.0) for a in self.adapters]

    def default_set(self) -> LoraSet:
        return tuple((i, s) for i, s in enumerate(self.scales) if s != 0.0)

    # ---- a request's set ---------------------------------------------------------------------

    def choose(
        self, params: GenerationParams, body: Mapping[str, Any], route: str, resident: ModelIdentity
    ) -> GenerationParams:
        """``params`` with the set the request runs under: its ``lora`` list (llama-server's:
        adapters it does not list at scale 0; an empty list, as llama-server reads it, asks
        for nothing: the base model is every adapter at 0), else the one adapter at scale 1 its ``model``
        names (vLLM's; ``params.model`` then names the adapter in the reply), else the
        default set. With adapters loaded, an HTTP request whose ``model`` names neither
        the served model nor an adapter is refused (404, vLLM's); RPC requests name models
        as the spec's ``model_fallback`` allows, and keep being served."""
        asked = body.get("model")
        adapter = self._by_name.get(asked) if isinstance(asked, str) else None
        listed = self._parse(body["lora"], "lora") if body.get("lora") is not None else None
        if listed is not None and body["lora"]:  # an empty list is no list (llama-server's reading)
            if adapter is not None:
                raise bad_param(f"model names the LoRA adapter {asked!r}, "
                                "and a lora list is given too: give one", "lora")
            return self._with(params, listed)
        if adapter is not None:
            return self._with(params, ((adapter.id, 1.0),), model=adapter.spec.name)
        if self.adapters and route != "decode" and asked is not None:
            if not isinstance(asked, str):
                raise bad_param("model must be a string", "model")
            if asked not in (resident.model_alias, resident.model_name):
                err = ParamError(f"The model `{asked[:200]}` does not exist (served: {resident.model_alias}, and the "
                                 f"LoRA adapters {', '.join(self.names)}).", "model")
                err.status = Status.NOT_FOUND
                raise err
        return self._with(params, self.default_set())

    def _with(self, params: GenerationParams, lora: LoraSet, *, model: str | None = None) -> GenerationParams:
        return replace(params, lora=lora, lora_name=self.label(lora), model=model)

    def _parse(self, value: Any, what: str) -> LoraSet:
        """A list of ``{"id", "scale"}`` as a set (a 400 naming the entry at fault)."""
        if not isinstance(value, list):
            raise bad_param(f'{what} must be an array of {{"id", "scale"}} objects', "lora")
        if value and not self.adapters:
            raise bad_param("no LoRA adapters are loaded (serve with --lora PATH)", "lora")
        chosen: dict[int, float] = {}
        for i, entry in enumerate(value):
            where = f"lora[{i}]"
            if not isinstance(entry, Mapping):
                raise bad_param(f'{where} must be an object {{"id", "scale"}}', "lora")
            aid, scale = entry.get("id"), entry.get("scale")
            if isinstance(aid, bool) or not isinstance(aid, int) or not 0 <= aid < len(self.adapters):
                raise bad_param(f"{where}.id: no LoRA adapter {aid!r} (ids 0..{len(self.adapters) - 1}: GET "
                                "/lora-adapters)", "lora")
            if (
                isinstance(scale, bool) or not isinstance(scale, int | float)
                or not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE
            ):
                raise bad_param(f"{where}.scale must be a number between {-MAX_LORA_SCALE:g} and "
                                f"{MAX_LORA_SCALE:g}", "lora")
            if aid in chosen:
                raise bad_param(f"{where}.id: adapter {aid} is listed twice", "lora")
            chosen[aid] = float(scale)
        return tuple(sorted((i, s) for i, s in chosen.items() if s != 0.0))

    # ---- a set as it leaves the engine ---------------------------------------------------------

    def label(self, lora: LoraSet) -> str | None:
        """A set's name: an adapter's name alone at scale 1 (vLLM's ``lora_name``), else each
        ``name*scale``, comma-joined; None: the base model. KV events and logs name it so."""
        if not lora:
            return None
        names = self.adapters
        if len(lora) == 1 and lora[0][1] == 1.0:
            return names[lora[0][0]].spec.name
        return ",".join(f"{names[i].spec.name}*{s:g}" for i, s in lora)

    def event_fields(self, lora: LoraSet) -> tuple[int | None, str | None]:
        """``lora_id`` (the adapter's id, for a set of one) and ``lora_name`` of a BlockStored."""
        return (lora[0][0] if len(lora) == 1 else None), self.label(lora)

    def claims(self, lora: LoraSet) -> list[dict[str, Any]]:
        """A set as KV claims carry it (``lora`` in a hand-off, PREFILL's meta, a DECODE's
        kv_metadata): each adapter's name, scale and file digest; [] for the base model."""
        return [
            {"name": self.adapters[i].spec.name, "digest": self.adapters[i].meta.digest, "scale": s} for i, s in lora
        ]

    # ---- use (vllm:lora_requests_info) -----------------------------------------------------------

    @contextmanager
    def waiting(self, lora: LoraSet) -> Iterator[None]:
        with _counted(self._waiting, lora):
            yield

    @contextmanager
    def running(self, lora: LoraSet) -> Iterator[None]:
        with _counted(self._running, lora):
            yield

    def in_use(self) -> tuple[list[str], list[str]]:
        """Names of the adapters requests run under, and of those requests wait for a slot under."""
        return [self.adapters[i].spec.name for i in sorted(self._running)], [
            self.adapters[i].spec.name for i in sorted(self._waiting)
        ]


@contextmanager
def _counted(counts: Counter[int], lora: LoraSet) -> Iterator[None]:
    for i, _ in lora:
        counts[i] += 1
    try:
        yield
    finally:
        for i, _ in lora:
            counts[i] -= 1
            if not counts[i]:
                del counts[i]
