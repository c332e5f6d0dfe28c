"""CONFIGURE (spec §2.4) inside the engine: per-slot T1 settings, and staged T2/T3 changes
(context rebuild, model reload) applied once every slot is idle."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..wire import sampling as sampling_keys
from .slots import SlotTable

log = logging.getLogger(__name__)


class SlotSettings:
    """T1: applied at once to a slot's defaults for later requests on it."""

    def __init__(self, slots: SlotTable) -> None:
        self._slots = slots
        self._config: list[dict[str, Any]] = [{} for _ in range(len(slots))]

    def of(self, slot_id: int) -> dict[str, Any]:
        return self._config[slot_id]

    def apply(self, slot_id: int, t1: dict[str, Any]) -> dict[str, Any]:
        self._slots.get(slot_id)  # NO_SLOT
        cfg = self._config[slot_id]
        for key, value in t1.items():
            if key == "sampling":  # canonical names: a later temp replaces an earlier temperature
                cfg.setdefault("sampling", {}).update(sampling_keys.canonical(value))
            else:
                cfg[key] = value
        return dict(t1)

    def generation_defaults(self, slot_id: int) -> dict[str, Any]:
        """The slot's T1 settings as one layer of request keys, flattened by the one rule
        (wire/sampling.py: its sampling keys beat its top-level ones; the request's layers,
        merged after it, beat both)."""
        cfg = self._config[slot_id]
        layer: dict[str, Any] = {k: cfg[k] for k in ("n_predict", "seed") if k in cfg}
        if "antiprompt" in cfg:
            layer["stop"] = cfg["antiprompt"]
        layer["sampling"] = cfg.get("sampling", {})
        return sampling_keys.flatten(layer)


class Reconfigurer:
    """T2/T3: staged by CONFIGURE, applied by ``run`` once every slot is idle. No slot can
    be claimed from the moment a change is staged until it has been applied."""

    def __init__(self, slots: SlotTable, apply: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self._slots = slots
        self._apply = apply
        self._staged: dict[str, Any] = {}
        self._changed = trio.Event()

    def stage(self, changes: dict[str, Any]) -> None:
        self._staged.update(changes)
        self._changed.set()

    @property
    def staged(self) -> dict[str, Any]:
        return dict(self._staged)

    async def run(self) -> None:
        while True:
            await self._changed.wait()
            self._changed = trio.Event()
            if not self._staged:
                continue
            # Drain: no new claims from now on, so the running requests' end is in sight even
            # under steady traffic (new ones wait, or get BUSY "engine is reconfiguring").
            self._slots.frozen = True
            try:
                busy = self._slots.n_busy
                if busy:
                    log.info("staged %s: waiting for %d running request(s) to end", sorted(self._staged), busy)
                while not self._slots.all_idle():
                    await self._slots.wait_released()
                changes, self._staged = self._staged, {}
                await self._apply(changes)
            except Exception:
                log.exception("staged reconfiguration failed; the engine keeps its old setup")
            finally:
                self._slots.frozen = False
                self._slots.notify()
