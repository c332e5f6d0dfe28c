"""llama.cpp's log, routed to Python logging (logger ``hydra_trio.llama_cpp``), and the
capture of what it says while a model loads or a context is built."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import llama_cpp

T = TypeVar("T")
llama_log = logging.getLogger("hydra_trio.llama_cpp")

# ggml_log_level: 0 NONE, 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT (continues the last line).
_LOG_LEVELS = {
    0: logging.DEBUG,
    1: logging.DEBUG,
    2: logging.DEBUG,  # llama.cpp's INFO is very chatty
    3: logging.WARNING,
    4: logging.ERROR,
}
_log_state = {"last": logging.DEBUG}
# Warnings llama.cpp prints on every load of common models (Gemma 3's vocabulary, SWA
# layers) that ask nothing of the operator: load chatter, so DEBUG like the rest of it.
_LOAD_NOTES = (b"load: control-looking token", b"llama_kv_cache_iswa: using full-size SWA cache")
# While a model loads or a context is built (on the GPU worker), llama.cpp's log lines are
# also collected here: they are the only place it says how many layers it offloaded and
# whether "auto" flash attention ended up on.
_log_capture: list[str] | None = None


@llama_cpp.llama_log_callback
def _route_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    py_level = _LOG_LEVELS.get(level, _log_state["last"])
    if py_level == logging.WARNING and text.startswith(_LOAD_NOTES):
        py_level = logging.DEBUG
    _log_state["last"] = py_level
    if _log_capture is not None:
        _log_capture.append(text.decode("utf-8", "replace"))
    if llama_log.isEnabledFor(py_level):
        msg = text.decode("utf-8", "replace").rstrip("\n")
        if msg:
            llama_log.log(py_level, "%s", msg)


_init_lock = threading.Lock()
_initialised = False


def init_llama() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            llama_cpp.llama_log_set(_route_llama_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True


def captured(fn: Callable[[], T]) -> tuple[T, list[str]]:
    """Run a llama call and return its result with the log lines it printed."""
    global _log_capture
    lines: list[str] = []
    _log_capture = lines
    try:
        return fn(), lines
    finally:
        _log_capture = None



_mtmd_routed = False


def route_mtmd_log() -> None:
    """mtmd's log (the projector's loader and encoder) into the same logger as llama.cpp's;
    called when a projector is loaded, so libmtmd is only opened by those who use it."""
    global _mtmd_routed
    with _init_lock:
        if not _mtmd_routed:
            from llama_cpp import mtmd_cpp

            mtmd_cpp.mtmd_helper_log_set(_route_llama_log, ctypes.c_void_p(0))
            _mtmd_routed = True
