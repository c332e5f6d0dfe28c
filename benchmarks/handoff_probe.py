"""Timestamps inside the engines for `python -m benchmarks.handoff_engine_parts` (issue 53).

``install()`` runs in an engine process (a generated ``sitecustomize`` imports it when
``HYDRA_PROBE_OUT`` names a file) and wraps the functions a TCP hand-off passes through,
on both sides, with enter/exit stamps: ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux,
one clock for every process on the host, the benchmark driver's included). Each stamp is
one line ``name<TAB>seconds`` appended to the file. Nothing in src/ knows of it: the
wrapped names are looked up where they are used, so main's tree and a branch's can be
probed alike (a name that is not there is skipped and the part shows as missing).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_out: Any = None


def stamp(name: str) -> None:
    t = time.perf_counter()
    with _lock:
        _out.write(f"{name}\t{t:.6f}\n")
        _out.flush()


def _wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awrapped(*a: Any, **k: Any) -> Any:
            stamp(name + ">")
            try:
                return await fn(*a, **k)
            finally:
                stamp(name + "<")

        return awrapped

    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        stamp(name + ">")
        try:
            return fn(*a, **k)
        finally:
            stamp(name + "<")

    return wrapped


# (module, attribute path where the caller looks it up, stamp name)
POINTS = [
    ("hydra_trio.engine.engine", "Engine.prepare", "prepare"),
    ("hydra_trio.engine.inputs", "Inputs.plan", "plan"),
    ("hydra_trio.engine.inputs", "Inputs.tokenize_text", "tokenize"),
    ("hydra_trio.http.completions.kv_transfer", "route", "route"),
    ("hydra_trio.http.completions.kv_transfer", "begin_handoff", "gate"),
    ("hydra_trio.http.completions.kv_transfer", "fetch_handoff", "fetch"),
    ("hydra_trio.http.completions.kv_transfer", "restore_handoff", "restore_handoff"),
    ("hydra_trio.handoff.restore", "pull_export", "pull"),
    ("hydra_trio.handoff.pull", "allowed_address", "resolve"),
    ("hydra_trio.handoff.pull", "read_reply_head", "reply_head"),
    ("hydra_trio.handoff.pull", "payload_buffer", "buffer"),
    ("hydra_trio.handoff.pull", "recv_exactly_hashing", "receive"),
    ("hydra_trio.handoff.pull", "check_pulled", "verify"),
    ("hydra_trio.engine.engine", "Engine.admit", "admit"),
    ("hydra_trio.engine.llama.kv_state", "SlotStates.state_restore", "llama_restore"),
    ("hydra_trio.rpc.ops", "OpTable.kv_pull", "p_kv_pull"),
    ("hydra_trio.rpc.connection", "Connection.send", "p_send"),
    ("hydra_trio.engine.kv.copy", "copy_out", "p_copy_out"),
]


def install(path: str) -> None:
    global _out
    _out = open(path, "a")  # held for the process's life
    for module, attr, name in POINTS:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        owner: Any = mod
        *outer, last = attr.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        fn = getattr(owner, last, None) if owner is not None else None
        if fn is not None:
            setattr(owner, last, _wrap(fn, name))


SITECUSTOMIZE = """import os
if os.environ.get("HYDRA_PROBE_OUT"):
    import benchmarks.handoff_probe as _p
    _p.install(os.environ["HYDRA_PROBE_OUT"])
"""


def read(path: str) -> list[tuple[str, float]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(n, float(t)) for n, t in (line.rstrip("\n").split("\t") for line in f if "\t" in line)]
