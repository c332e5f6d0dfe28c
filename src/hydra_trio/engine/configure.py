"""CONFIGURE (spec §2.4), all of it: which tier each key is, how each is validated, T1's
per-slot settings, and T2/T3 changes (context rebuild, model reload) staged until every slot
is idle, then applied by the engine (``Engine.apply_staged``)."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from ..config import CACHE_TYPES, Settings, cache_type_problem
from ..wire import sampling as sampling_keys
from ..wire.errors import ErrorCode, ParamError, ProtocolError, Status
from .params import BOUNDS, check_value, parse_stop
from .sched import SlotTable

log = logging.getLogger(__name__)

# CONFIGURE tiers (spec §2.4). T1: a slot's defaults for later requests on it: every
# generation key with a bound (params.BOUNDS: the spec's n_predict, seed and sampling keys,
# top-level or under "sampling", and the rest of them), antiprompt (its stop strings), n_keep,
# state_chunk_size. T2 rebuilds the context, T3 reloads the model, when every slot is idle.
_T1_OWN_KEYS = {"n_keep", "antiprompt", "state_chunk_size"}
_T2_KEYS = {"n_ctx", "cache_type_k", "cache_type_v"}
_T3_KEYS = {"model_path"}
# Keys coordinators send that this engine takes but cannot apply per slot: why, for
# params_unused (docs/rpc-protocol.md §4 lists the coordinator's keys).
_NOT_APPLIED = {
    "n_keep": "accepted, not applied: no context shifting (generation stops at the context limit)",
    "batch": "accepted, not applied: the batch size is fixed at start (--batch-size)",
    "n_batch": "accepted, not applied: the batch size is fixed at start (--batch-size)",
    "ctx": "accepted, not applied: the context size is fixed at start (--ctx-size); n_ctx (T2) rebuilds it",
}
CHUNK_MIN, CHUNK_MAX = 64 * 1024, 64 * 1024 * 1024


@dataclass(slots=True)
class ConfigureOutcome:
    """What one CONFIGURE did: the reply's fields."""

    tier: str
    applied: dict[str, Any] = field(default_factory=dict)
    unused: dict[str, str] = field(default_factory=dict)
    deferred: list[str] = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "success": True,
            "tier": self.tier,
            "params_applied": self.applied,
            "deferred_keys": self.deferred,
        }
        if self.unused:
            meta["params_unused"] = self.unused
        return meta


class Configurable(Protocol):
    """What CONFIGURE changes (the engine)."""

    slot_settings: SlotSettings
    reconfigurer: Reconfigurer
    model_dir: str

    @property
    def flash_attn_applied(self) -> str: ...


async def configure(engine: Configurable, slot_id: int, body: dict[str, Any], settings: Settings) -> ConfigureOutcome:
    """Sort a CONFIGURE's keys into tiers, refuse what this engine's --configure-tiers or
    the keys' rules do not allow, apply T1 to the slot and stage T2/T3. Every key is applied,
    staged, or named in ``params_unused`` with the reason."""
    staged = {k: v for k, v in body.items() if k in _T2_KEYS or k in _T3_KEYS}
    t1, unused = _validate_t1({k: v for k, v in body.items() if k not in staged})
    tier = "T3" if _T3_KEYS & staged.keys() else "T2" if staged else "T1"
    allowed = settings.configure_tier_set()
    for name, used in (("T1", t1), ("T2", _T2_KEYS & staged.keys()), ("T3", _T3_KEYS & staged.keys())):
        if used and name not in allowed:
            raise _refused(f"CONFIGURE {name} ({', '.join(sorted(used))}) is off on this engine (--configure-tiers "
                           f"{settings.configure_tiers})")
    if staged:
        staged = _validate_staged(staged, flash_attn=engine.flash_attn_applied)
        if "model_path" in staged:
            staged["model_path"] = await trio.to_thread.run_sync(_model_in, engine.model_dir, staged["model_path"])
    applied = engine.slot_settings.apply(slot_id, t1) if t1 else {}
    if staged:
        engine.reconfigurer.stage(staged)
    return ConfigureOutcome(tier, applied, unused, sorted(staged))


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_JSON, msg, status=Status.BAD_REQUEST)


def _refused(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_KEY, msg, status=Status.BAD_REQUEST)


def _model_in(model_dir: str, path: str) -> str:
    """``path`` resolved (symlinks too), if it is a regular file inside ``model_dir``: a T3
    reload reads nothing else (not another folder, not a FIFO or device that would block the
    loader with the slots frozen). Runs in a thread: it stats the filesystem."""
    real = os.path.realpath(os.path.join(model_dir, path))
    root = os.path.realpath(model_dir)
    if os.path.commonpath([real, root]) != root:
        raise _refused(f"model_path must be inside --model-dir {root}")
    try:
        st = os.stat(real)
    except OSError as exc:
        raise _bad(f"model_path {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(f"model_path {path!r} is not a regular file")
    if not os.access(real, os.R_OK):
        raise _bad(f"model_path {path!r} is not readable")
    return real


def _validate_t1(body: dict[str, Any]) -> tuple[sampling_keys.Layer, dict[str, str]]:
    """The T1 keys of ``body`` flattened by the one precedence rule (wire/sampling.py) and
    validated by the one validation of generation values (params.check_value), and what is
    not applied, with why. A bad value is refused (BAD_JSON), as a request would be."""
    if body.get("sampling") is not None and not isinstance(body["sampling"], dict):
        raise _bad("sampling must be an object")
    keys = sampling_keys.flatten({k: v for k, v in body.items() if not (k == "sampling" and v is None)})
    out = sampling_keys.Layer()
    unused: dict[str, str] = {}
    for key, value in keys.items():
        name = keys.name(key)
        try:
            if key in BOUNDS:
                out[key] = check_value(key, value, name)
            elif key == "antiprompt":
                out["stop"] = parse_stop(value, name)
                out.spelled["stop"] = name
                continue
            elif key == "state_chunk_size":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise _bad("state_chunk_size must be an integer")
                out[key] = min(max(value, CHUNK_MIN), CHUNK_MAX)
            elif key in _NOT_APPLIED:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise _bad(f"{name} must be an integer")
                unused[name] = _NOT_APPLIED[key]
                continue
            else:
                unused[name] = "unknown key: not a CONFIGURE key of this engine"
                continue
        except ParamError as err:
            raise _bad(err.message) from None
        out.spelled[key] = name
    return out, unused


def _validate_staged(staged: dict[str, Any], *, flash_attn: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "n_ctx" in staged:
        v = staged["n_ctx"]
        if isinstance(v, bool) or not isinstance(v, int) or not 64 <= v <= 1 << 20:
            raise _bad("n_ctx must be an integer in 64..1048576")
        out["n_ctx"] = v
    for key in ("cache_type_k", "cache_type_v"):
        if key in staged:
            v = staged[key]
            if not isinstance(v, str) or v.lower() not in CACHE_TYPES:
                raise _bad(f"{key} must be one of {sorted(CACHE_TYPES)}")
            out[key] = CACHE_TYPES[v.lower()]
            if key == "cache_type_v" and (problem := cache_type_problem(v.lower(), flash_attn)) is not None:
                raise _bad(problem)
    if "model_path" in staged:
        v = staged["model_path"]
        if not isinstance(v, str) or not v:
            raise _bad("model_path must be a non-empty string")
        out["model_path"] = v
    return out


class SlotSettings:
    """T1: applied at once to a slot's defaults for later requests on it, key by key (a later
    CONFIGURE's key replaces the earlier one, whatever its spelling)."""

    def __init__(self, slots: SlotTable) -> None:
        self._slots = slots
        self._config = [sampling_keys.Layer() for _ in range(len(slots))]

    def chunk_size(self, slot_id: int) -> int | None:
        """The slot's STATE_GET send chunk (state_chunk_size), None: the whole blob at once."""
        return self._config[slot_id].get("state_chunk_size")

    def apply(self, slot_id: int, t1: sampling_keys.Layer) -> dict[str, Any]:
        """Take validated T1 keys; returns them as the reply's ``params_applied``, spelled as
        sent (a ``sampling`` object's keys under ``sampling``)."""
        self._slots.get(slot_id)  # NO_SLOT
        self._config[slot_id].update_from(t1)
        applied: dict[str, Any] = {}
        for key, value in t1.items():
            name = t1.name(key)
            shown = list(value) if key == "stop" else value
            if name.startswith("sampling."):
                applied.setdefault("sampling", {})[name.removeprefix("sampling.")] = shown
            else:
                applied[name] = shown
        return applied

    def generation_defaults(self, slot_id: int) -> sampling_keys.Layer:
        """The slot's T1 settings as the first layer of a request's keys (wire/sampling.py:
        the request's layers, merged after it, beat it key by key)."""
        cfg = self._config[slot_id]
        return sampling_keys.Layer(
            {k: v for k, v in cfg.items() if k != "state_chunk_size"},
            {k: v for k, v in cfg.spelled.items() if k != "state_chunk_size"},
        )


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
