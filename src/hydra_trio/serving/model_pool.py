"""Many models behind one process, as llama-server's router mode serves them, in-process: each
model's ``Engine`` is a service in the pool's own nursery, loaded on demand (a request's
``model`` picks it), at most ``--models-max`` holding memory at once, the least recently
used idle one evicted to make room, pinned ones (``--model-pin``, the RPC model) loaded from
start to stop, and an idle one put to sleep after ``--sleep-idle-seconds``.

The rules that make it safe, each in one place here:

- **One load, many waiters.** A load (or a wake) runs as a task of the pool, not of the
  request that asked for it: every request for the model waits on the same ``transition``
  event, each under its own deadline (the caller's scope), and one that leaves cancels
  nothing. A failed load fails its waiters; the next request tries again.
- **No unload under a request.** A request holds its model (``acquire`` ... ``release``)
  for its whole life; only a model nobody holds is evicted, put to sleep or unloaded, and
  the decision and the state change happen with no checkpoint between them, so no request
  slips in. An eviction that finds every resident model busy waits (the caller's deadline)
  for one to become idle; an explicit unload of a busy model is refused.
- **Memory is counted until it is free.** A model being unloaded still counts against
  ``--models-max`` until its engine has freed the model; a sleeping one counts no more.
- **All llama.cpp calls on one lane.** The engines share one ``WorkerLane`` (the GPU
  worker's limiter), so loads, steps and frees of different models never run at once
  (docs/performance.md "Many models": measured against a lane per model).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

import trio

from ..engine import Engine, WorkerLane

if TYPE_CHECKING:
    from ..config import Settings
    from ..model.catalog import Catalog

log = logging.getLogger("hydra_trio.models")


class ModelState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"  # a load or a wake runs
    LOADED = "loaded"
    SLEEPING = "sleeping"  # idle past --sleep-idle-seconds: memory freed, woken by its next request


class ModelError(Exception):
    """A model request the pool refuses; ``message`` says why in the client's words."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ModelBusy(ModelError):
    """Not now, retry: the model serves requests (an unload), or no room came in time."""


class ModelRefused(ModelError):
    """Not in this state: not running, already loaded, pinned."""


class ModelLoadFailed(ModelError, RuntimeError):
    """The model's load failed (the cause is chained); the next request tries again."""


@dataclass(eq=False)
class ModelEntry:
    """One model by name: where it is, what state it is in, who holds it, what it cost."""

    name: str
    path: str
    source: str  # "flag", "models_dir" or "model" (the one --model PATH)
    pinned: bool
    state: ModelState = ModelState.UNLOADED
    engine: Engine | None = None
    users: int = 0  # requests holding it now
    waiting: int = 0  # requests waiting for it to load, wake or find room
    last_used: float = -math.inf  # trio clock: the last acquire or release (LRU, idle sleep)
    # Set when the load, wake or unload under way ends (None: none is).
    transition: trio.Event | None = None
    failure: BaseException | None = None  # the last load's failure, until a load starts again
    loads: int = 0  # cold loads that succeeded
    wakes: int = 0
    sleeps: int = 0
    evictions: int = 0
    unloads: int = 0  # by POST /models/unload
    last_load_s: float | None = None
    last_wake_s: float | None = None
    _freed: trio.Event | None = field(default=None, repr=False)  # the engine's run has ended
    _load_scope: trio.CancelScope | None = field(default=None, repr=False)

    @property
    def holds_memory(self) -> bool:
        """Loaded, loading or waking, or still freeing what it held."""
        return self.state is ModelState.LOADED or self.transition is not None


class ModelPool:
    """The models of one process by name (``Catalog``), or the one model of a process started
    with a single ``--model`` (``strict`` False: every name is that model, as always)."""

    def __init__(self, settings: Settings, catalog: Catalog | None = None) -> None:
        self._settings = settings
        self.strict = catalog is not None
        self.models_max = settings.models_max if catalog is not None else 1
        self._sleep_s = settings.sleep_idle_seconds if settings.sleep_idle_seconds > 0 else math.inf
        self._entries: dict[str, ModelEntry] = {}
        self.default_name = ""  # missing ``model``: this one (the RPC model)
        if catalog is not None:
            for e in catalog.entries:
                self._entries[e.name] = ModelEntry(e.name, e.path, e.source, e.name in catalog.pinned)
            self.default_name = catalog.rpc_model
            self._check_room()
        self.lane = WorkerLane()  # every engine's llama.cpp calls, one at a time
        self._nursery: trio.Nursery | None = None
        self._change = trio.Event()  # set (and replaced) at every release and state change
        self._news = trio.Event()  # that, and a waiter's coming and going (wait_changed)
        self._stop = trio.Event()
        self._closing = False

    def _check_room(self) -> None:
        pinned = [e.name for e in self._entries.values() if e.pinned]
        others = len(self._entries) - len(pinned)
        if len(pinned) > self.models_max or (len(pinned) == self.models_max and others):
            raise SystemExit(
                f"--models-max {self.models_max} leaves no room: {len(pinned)} pinned "
                f"({', '.join(pinned)}: --model-pin and the RPC model) and {others} more to load on demand"
            )

    # ---- what it serves ------------------------------------------------------------------

    def find(self, name: str | None) -> ModelEntry | None:
        """The model a request names; ``None`` (no ``model``): the default one. None: no model
        of that name (the caller may look further: an adapter's name, issue 51's LoRA)."""
        if not self.strict or name is None:
            return self._entries.get(self.default_name)
        return self._entries.get(name)

    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def loaded(self) -> Iterator[tuple[ModelEntry, Engine]]:
        """The models whose engine serves now (metrics, the drain)."""
        for entry in self._entries.values():
            if entry.engine is not None:
                yield entry, entry.engine

    def engine(self, name: str) -> Engine:
        """A pinned model's engine (the RPC model's): loaded from start to stop."""
        entry = self._entries[name]
        assert entry.pinned and entry.engine is not None, f"{name} is pinned and loaded"
        return entry.engine

    # ---- lifecycle -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own every engine, load and free until ``stop()``: its lifetime is shielded, as an
        engine's is, so it ends after its users (the front ends, the decode manager)."""
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                watching = trio.CancelScope()
                if self._sleep_s < math.inf:
                    nursery.start_soon(self._put_idle_to_sleep, watching)
                task_status.started()
                await self._stop.wait()
                watching.cancel()
                for entry in self._entries.values():
                    if entry._load_scope is not None:
                        entry._load_scope.cancel()  # a load stopped here frees what it loaded
                    if entry.engine is not None:
                        entry.engine.stop()
                        entry.engine, entry.state = None, ModelState.UNLOADED

    def stop(self) -> None:
        """Free every model (their requests have ended: the front ends stopped first)."""
        self._closing = True
        self._stop.set()

    async def adopt(self, engine: Engine, path: str) -> None:
        """The one model of a single ``--model`` process, loaded by the caller: served here,
        pinned, under its served name."""
        name = engine.served_name
        entry = self._entries[name] = ModelEntry(name, path, "model", True)
        self.default_name = name
        await self._serve(entry, engine)

    async def start_pinned(self) -> None:
        """Load the pinned models (the RPC model first), one after another, before the
        process is ready; a failure stops the start (ModelLoadFailed, its cause chained)."""
        order = sorted((e for e in self._entries.values() if e.pinned), key=lambda e: e.name != self.default_name)
        for entry in order:
            await self._ready(entry, hold=False)

    # ---- requests --------------------------------------------------------------------------

    async def acquire(self, entry: ModelEntry) -> Engine:
        """The model's engine, held for the caller until ``release`` (never unloaded meanwhile):
        loaded or woken first when it is not, after room is made. Waits within the caller's
        scope (its deadline); a failed load raises ModelLoadFailed."""
        engine = await self._ready(entry, hold=True)
        assert engine is not None
        return engine

    def release(self, entry: ModelEntry) -> None:
        entry.users -= 1
        entry.last_used = trio.current_time()
        self._changed()

    async def load(self, entry: ModelEntry) -> None:
        """POST /models/load: load (or wake) it now, returning once it serves."""
        if entry.state is ModelState.LOADED and entry.transition is None:
            raise ModelRefused("model is already running")
        await self._ready(entry, hold=False)

    async def unload(self, entry: ModelEntry) -> None:
        """POST /models/unload: free it now, returning once its memory is free. Refused while
        requests hold it (ModelBusy: retry), while it loads, and for a pinned model."""
        if entry.pinned:
            raise ModelRefused(f"model {entry.name} is pinned (--model-pin, or the RPC model): it stays loaded")
        if entry.state is ModelState.SLEEPING and entry.transition is None:
            entry.state = ModelState.UNLOADED  # it holds nothing already
            entry.unloads += 1
            self._changed()
            return
        if entry.state is ModelState.LOADING:
            raise ModelBusy(f"model {entry.name} is loading: unload it once it is loaded")
        if entry.state is not ModelState.LOADED or entry.transition is not None:
            raise ModelRefused("model is not running")
        if entry.users:
            raise ModelBusy(f"model {entry.name} is serving {entry.users} requests: not unloaded (retry once they end)")
        transition = self._begin_unload(entry, ModelState.UNLOADED, "unloaded by POST /models/unload")
        entry.unloads += 1
        with trio.CancelScope(shield=True):  # the unload goes on anyway; its answer waits for it
            await transition.wait()

    # ---- the one state machine -------------------------------------------------------------

    async def _ready(self, entry: ModelEntry, *, hold: bool) -> Engine | None:
        """Until the model serves (``hold``: then counted as a user, before any checkpoint)."""
        while True:
            if self._closing:
                raise ModelBusy("the engine is stopping")
            if entry.state is ModelState.LOADED and entry.transition is None:
                if hold:
                    entry.users += 1
                    entry.last_used = trio.current_time()
                    self._tell()
                return entry.engine
            if entry.transition is not None:  # a load, a wake or an unload under way
                await self._wait(entry, entry.transition)
                if entry.failure is not None and entry.state is ModelState.UNLOADED:
                    raise ModelLoadFailed(f"model {entry.name} failed to load: {entry.failure}") from entry.failure
                continue
            if self._resident() < self.models_max:
                self._begin_load(entry)
                continue
            victim = None if self._freeing() else self._lru_idle()  # room being made: wait for it
            if victim is not None:
                self._begin_unload(victim, ModelState.UNLOADED, f"evicted for {entry.name} (--models-max "
                                   f"{self.models_max})")
                victim.evictions += 1
                continue
            await self._wait(entry, self._change)  # a model is being freed, or every resident one serves requests

    async def _wait(self, entry: ModelEntry, event: trio.Event) -> None:
        """Wait for ``event``, counted among the model's waiters (news for observers only:
        a waiter's coming and going moves nothing another waiter waits for)."""
        entry.waiting += 1
        self._tell()
        try:
            await event.wait()
        finally:
            entry.waiting -= 1
            self._tell()

    def _resident(self) -> int:
        return sum(1 for e in self._entries.values() if e.holds_memory)

    def _freeing(self) -> bool:
        return any(e.transition is not None and e.state is not ModelState.LOADING for e in self._entries.values())

    def _lru_idle(self) -> ModelEntry | None:
        idle = [
            e for e in self._entries.values()
            if e.state is ModelState.LOADED and e.transition is None and not e.pinned and e.users == 0
        ]
        return min(idle, key=lambda e: e.last_used, default=None)

    def _changed(self) -> None:
        """A state changed or a holder let go: room may have come, a model may be idle."""
        self._change.set()
        self._change = trio.Event()
        self._tell()

    def _tell(self) -> None:
        self._news.set()
        self._news = trio.Event()

    async def wait_changed(self) -> None:
        """Until the next change of any model's state, holders or waiters (the drain, tests)."""
        await self._news.wait()

    def _begin_load(self, entry: ModelEntry) -> None:
        assert self._nursery is not None, "the pool runs"
        wake = entry.state is ModelState.SLEEPING
        entry.state, entry.failure, entry.transition = ModelState.LOADING, None, trio.Event()
        entry._load_scope = trio.CancelScope()
        self._nursery.start_soon(self._load, entry, wake, entry._load_scope)
        self._changed()

    async def _load(self, entry: ModelEntry, wake: bool, scope: trio.CancelScope) -> None:
        t0 = time.perf_counter()
        log.info("model %s: %s (%s)", entry.name, "waking" if wake else "loading", entry.path)
        engine: Engine | None = None
        try:
            with scope:
                engine = await Engine.load(
                    entry.path, self._settings_for(entry, wake), alias=entry.name, lane=self.lane
                )
        except (Exception, SystemExit) as exc:  # SystemExit: the engine's refusal of a setting for this model
            entry.failure = exc
            log.error("model %s failed to load: %s", entry.name, exc)
        entry._load_scope = None
        if engine is None or self._closing:
            if engine is not None:  # loaded as the pool stops: served, to be freed as every engine is
                with trio.CancelScope(shield=True):
                    await self._serve(entry, engine)
                engine.stop()
            entry.engine, entry.state = None, ModelState.UNLOADED
            self._end(entry)
            return
        seconds = time.perf_counter() - t0
        if wake:
            entry.wakes, entry.last_wake_s = entry.wakes + 1, seconds
        else:
            entry.loads, entry.last_load_s = entry.loads + 1, seconds
        await self._serve(entry, engine)
        log.info("model %s: %s in %.0f ms", entry.name, "awake" if wake else "loaded", seconds * 1000.0)
        self._end(entry)

    async def _serve(self, entry: ModelEntry, engine: Engine) -> None:
        """Start the engine's service in the pool's nursery; the model then serves."""
        assert self._nursery is not None, "the pool runs"
        freed = trio.Event()

        async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await engine.run(task_status=task_status)
            finally:
                freed.set()

        await self._nursery.start(serve)
        entry.engine, entry._freed = engine, freed
        entry.state, entry.last_used = ModelState.LOADED, trio.current_time()

    def _begin_unload(self, entry: ModelEntry, to: ModelState, why: str) -> trio.Event:
        """Free an idle model's memory (``to``: UNLOADED, or SLEEPING for an idle one): the
        decision and the state change with no checkpoint between, so no request comes in."""
        assert self._nursery is not None and entry.users == 0 and entry.engine is not None
        engine, freed = entry.engine, entry._freed
        assert freed is not None
        entry.engine, entry.state, entry.transition = None, to, trio.Event()
        if to is ModelState.SLEEPING:
            entry.sleeps += 1
        self._nursery.start_soon(self._free, entry, engine, freed, why)
        self._changed()
        return entry.transition

    async def _free(self, entry: ModelEntry, engine: Engine, freed: trio.Event, why: str) -> None:
        t0 = time.perf_counter()
        engine.stop()
        await freed.wait()
        # The engine's Python side (its vocabulary table, slots, batcher) is in reference
        # cycles: collected now, not at the collector's next full pass, so memory does not
        # hold dead engines between switches (a few ms: start-up's objects are frozen, app.py).
        del engine
        t1 = time.perf_counter()
        gc.collect()
        log.info("model %s: %s, memory freed in %.0f ms (garbage collected in %.1f ms)",
                 entry.name, why, (time.perf_counter() - t0) * 1000.0, (time.perf_counter() - t1) * 1000.0)
        self._end(entry)

    def _end(self, entry: ModelEntry) -> None:
        transition, entry.transition = entry.transition, None
        if transition is not None:
            transition.set()
        self._changed()

    async def _put_idle_to_sleep(self, scope: trio.CancelScope) -> None:
        """--sleep-idle-seconds: a model nobody has held for that long frees its memory."""
        with scope:
            while True:
                now, due = trio.current_time(), math.inf
                for entry in self._entries.values():
                    if (
                        entry.pinned
                        or entry.state is not ModelState.LOADED
                        or entry.transition is not None
                        or entry.users
                    ):
                        continue
                    at = entry.last_used + self._sleep_s
                    if at <= now:
                        self._begin_unload(entry, ModelState.SLEEPING, f"asleep after {self._sleep_s:g} s idle")
                    else:
                        due = min(due, at)
                with trio.move_on_at(due):
                    await self._change.wait()

    def _settings_for(self, entry: ModelEntry, wake: bool) -> Settings:
        """A model's settings: the process's, named as the pool names it, with no CONFIGURE
        T3 (another model under this name would break the name's promise), and no warm-up
        on a wake (this machine ran the model's kernels already)."""
        tiers = ",".join(t for t in sorted(self._settings.configure_tier_set()) if t != "T3")
        return replace(
            self._settings, model=entry.path, alias=entry.name, configure_tiers=tiers,
            warmup=self._settings.warmup and not wake,
        )
