"""Where llama.cpp's weights and buffers live: GPU offload (what was asked for, the ggml
devices there are, what llama.cpp applied), repacking, and the C allocator's placement.

The device list comes from ggml's backend registry (``ggml_backend_dev_*``), which
llama-cpp-python does not wrap: it is bound here with ctypes from the ggml shared libraries
inside the llama_cpp package's lib folder (the same files llama_cpp loaded, so the same
registry). Reading it is a native call: it runs once at model load, on the GPU worker.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# CPU flags of Intel AMX as Linux names them in /proc/cpuinfo. llama.cpp's AMX kernels on
# repacked weights crash (SIGSEGV in ggml_backend_amx_mul_mat: ggml-org/llama.cpp#20824, open),
# so weights are not repacked on such CPUs unless the operator asks (--repack).
AMX_CPU_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")

# llama_flash_attn_type
FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}
# ggml_backend_dev_type
_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}

# Lines llama.cpp logs while loading and creating a context (routed to our logger at DEBUG).
_OFFLOADED_RE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
# "auto" resolved by probing the devices, or forced on (quantized V cache, tensor split).
_FA_ENABLED_RE = re.compile(r"Flash Attention enabled|enabling flash_attn since it is required")
_FA_DISABLED_RE = re.compile(r"Flash Attention not supported, set to disabled")
# Weights llama.cpp repacked (its CPU "extra buffer types": CPU_REPACK, AMX, KleidiAI).
_REPACK_BUFFER_RE = re.compile(r"(?:CPU_REPACK|AMX|KLEIDIAI)\S* model buffer size =\s*([\d.]+) MiB")


# glibc's mallopt parameter, and the most it accepts for it (its own ceiling for the
# threshold it raises by itself as large blocks are freed).
_M_MMAP_THRESHOLD = -3
HEAP_BUFFER_BYTES = 32 << 20
_heap_lock = threading.Lock()
_heap_choice: str | None = None


def heap_for_buffers() -> str:
    """Have glibc serve llama.cpp's buffers of up to 32 MiB (the sliding-window KV cache, the
    repacked weights, the output buffer) from its heap instead of one mmap each; once per
    process, before the first model loads. Measured on Gemma 3 270M (AMD EPYC, one thread,
    docs/performance.md "The C allocator"): with glibc's default the engine's prefill took
    1.06-1.10x llama-server's, round after round, and 0.98-1.02x with this, in the same runs;
    the bare backend in a plain Python process was either, from run to run. The threshold is
    the value glibc itself moves to after freeing a block of that size, so the engine's
    other allocations behave as in any long-lived process. An operator's own
    ``MALLOC_MMAP_THRESHOLD_`` (or ``GLIBC_TUNABLES`` with it) is left as it is. Returns what
    was done, for the start-up log."""
    global _heap_choice
    with _heap_lock:
        if _heap_choice is None:
            _heap_choice = _set_heap_threshold()
            log.debug("C allocator: %s", _heap_choice)
        return _heap_choice


def _set_heap_threshold() -> str:
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return "the operator's mmap threshold"
    try:
        libc = ctypes.CDLL(None)
        # glibc only: another libc's mallopt (musl's does nothing) is not this setting.
        glibc = hasattr(libc, "gnu_get_libc_version")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        glibc = False
    if not glibc:
        return "not glibc: left as it is"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, HEAP_BUFFER_BYTES) != 1:
        return "glibc refused the mmap threshold: left as it is"
    return f"blocks up to {HEAP_BUFFER_BYTES >> 20} MiB from the heap (mmap threshold)"


@dataclass(frozen=True, slots=True)
class OffloadSettings:
    """What the operator asked for (flags --n-gpu-layers, --main-gpu, --flash-attn,
    --no-kv-offload, --repack)."""

    n_gpu_layers: int | None = None  # None: all when the build can offload, else 0; -1: all
    main_gpu: int = 0
    flash_attn: str = "auto"  # on | off | auto
    kv_offload: bool = True
    repack: bool | None = None  # None: decided from the CPU (repack_choice)

    def resolved_gpu_layers(self, supports_offload: bool) -> int:
        """The value given to llama_model_params.n_gpu_layers (-1 = every layer)."""
        if self.n_gpu_layers is None:
            return -1 if supports_offload else 0
        return self.n_gpu_layers

    @property
    def flash_attn_type(self) -> int:
        return FLASH_ATTN_TYPES[self.flash_attn]


@dataclass(frozen=True, slots=True)
class RepackChoice:
    """Whether llama.cpp may repack weights into CPU-specific layouts
    (``llama_model_params.use_extra_bufts``, llama-server's --repack/--no-repack), and why."""

    enabled: bool
    reason: str


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where there is no
    /proc/cpuinfo, e.g. macOS: no CPU there has AMX)."""
    try:
        with open(cpuinfo_path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def repack_choice(asked: bool | None, flags: frozenset[str]) -> RepackChoice:
    """The one rule for repacking: the operator's word when given, else on except where the
    CPU has AMX (llama.cpp's AMX kernels crash on repacked weights; without AMX, repacking
    speeds up prompts of Q4_0/Q4_K/IQ4_NL weights: docs/operations.md "Repacked weights")."""
    amx = [f for f in AMX_CPU_FLAGS if f in flags]
    if asked is not None:
        said = "--repack" if asked else "--no-repack"
        if asked and amx:
            return RepackChoice(True, f"{said} given, although this CPU has AMX ({' '.join(amx)}), whose llama.cpp "
                                "kernels crash on repacked weights (ggml-org/llama.cpp#20824)")
        return RepackChoice(asked, f"{said} given")
    if amx:
        return RepackChoice(False, f"off by default: this CPU has AMX ({' '.join(amx)}), whose llama.cpp kernels crash "
                            "on repacked weights (ggml-org/llama.cpp#20824); --repack forces it")
    return RepackChoice(True, "on by default (no AMX on this CPU)")


@dataclass(frozen=True, slots=True)
class GgmlDevice:
    index: int
    name: str
    description: str
    type: str  # cpu | gpu | igpu | accel
    memory_free: int  # bytes
    memory_total: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "description": self.description,
            "type": self.type,
            "memory_free": self.memory_free,
            "memory_total": self.memory_total,
        }


@dataclass(frozen=True, slots=True)
class OffloadReport:
    """What llama.cpp really did with the request, for the log, /version and INFO."""

    requested: OffloadSettings
    gpu_offload_supported: bool
    n_gpu_layers_param: int  # what llama_model_params.n_gpu_layers was set to
    n_gpu_layers: int  # layers llama.cpp placed on a GPU (its "offloaded N/M" count)
    n_layers: int  # n_layer + 1 (the output layer counts as one, as in llama.cpp)
    flash_attn: str  # on | off: what the context uses (auto resolved by llama.cpp)
    repack: RepackChoice
    repacked_mib: float = 0.0  # weights llama.cpp laid out anew (most types and shapes it cannot)
    devices: tuple[GgmlDevice, ...] = field(default=())

    @property
    def gpu_devices(self) -> list[GgmlDevice]:
        return [d for d in self.devices if d.type in ("gpu", "igpu")]

    def as_dict(self) -> dict[str, Any]:
        req = self.requested
        return {
            "gpu_offload_supported": self.gpu_offload_supported,
            "n_gpu_layers_requested": self.n_gpu_layers_param,
            "n_gpu_layers": self.n_gpu_layers,
            "n_layers": self.n_layers,
            "main_gpu": req.main_gpu,
            "kv_offload": req.kv_offload,
            "flash_attn_requested": req.flash_attn,
            "flash_attn": self.flash_attn,
            "repack_requested": req.repack,
            "repack": self.repack.enabled,
            "repack_reason": self.repack.reason,
            "repacked_mib": self.repacked_mib,
            "devices": [d.as_dict() for d in self.devices],
        }

    def summary(self) -> str:
        """One log line: how many layers went where."""
        on_cpu = self.n_layers - self.n_gpu_layers
        if self.n_gpu_layers == 0:
            where = f"all {self.n_layers} layers on CPU"
            if not self.gpu_offload_supported:
                where += " (this llama.cpp build has no GPU backend)"
        else:
            gpus = ", ".join(f"{d.name} ({d.description})" for d in self.gpu_devices) or "GPU"
            where = f"{self.n_gpu_layers}/{self.n_layers} layers on {gpus}, {on_cpu} on CPU"
        if self.n_gpu_layers == 0:
            kv = "KV cache on CPU"
        elif self.requested.kv_offload:
            kv = "KV cache with its layers (GPU for offloaded ones)"
        else:
            kv = "KV cache on CPU (--no-kv-offload)"
        repack = f"{self.repacked_mib:.1f} MiB of weights repacked" if self.repack.enabled else "weights not repacked"
        return (
            f"{where}; {kv}; flash attention {self.flash_attn} (asked {self.requested.flash_attn}); "
            f"{repack} ({self.repack.reason})"
        )


def offloaded_layers(
    log_lines: list[str], n_layers: int, supports_offload: bool, param: int
) -> int:
    """Layers on a GPU: llama.cpp's own "offloaded N/M layers to GPU" line when it printed
    one, else what its rule gives (a CPU-only build offloads nothing)."""
    for line in log_lines:
        m = _OFFLOADED_RE.search(line)
        if m:
            return int(m.group(1))
    if not supports_offload:
        return 0
    return n_layers if param < 0 else min(param, n_layers)


def repacked_mib(load_log: list[str]) -> float:
    """MiB of weights in repacked buffers, from llama.cpp's load lines (0: none repacked)."""
    return sum(float(m.group(1)) for line in load_log if (m := _REPACK_BUFFER_RE.search(line)))


def flash_attn_applied(log_lines: list[str], requested: str) -> str:
    """on | off for the context: "auto" is resolved by llama.cpp, which logs the outcome."""
    if requested != "auto":
        return requested
    for line in log_lines:
        if _FA_ENABLED_RE.search(line):
            return "on"
        if _FA_DISABLED_RE.search(line):
            return "off"
    return "off"  # llama.cpp logs "enabled" whenever auto turns it on


def _lib_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _load(lib_dir: Path, stem: str) -> ctypes.CDLL | None:
    for name in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll"):
        path = lib_dir / name
        if path.exists():
            return ctypes.CDLL(str(path))
    return None


def read_ggml_devices() -> tuple[GgmlDevice, ...]:
    """Every device in ggml's backend registry (CPU included). Empty if the libraries cannot
    be found (then only the log line says where layers went)."""
    lib_dir = _lib_dir()
    if lib_dir is None:
        return ()
    try:
        ggml = _load(lib_dir, "ggml")
        base = _load(lib_dir, "ggml-base") or ggml
    except OSError as exc:
        log.warning("cannot load the ggml libraries from %s: %s", lib_dir, exc)
        return ()
    if ggml is None or base is None:
        log.warning("no ggml library in %s: device list unavailable", lib_dir)
        return ()
    try:
        return _list_devices(ggml, base)
    except AttributeError as exc:  # a ggml build without the device API: report, do not fail
        log.warning("ggml in %s has no device API (%s): device list unavailable", lib_dir, exc)
        return ()


def _list_devices(ggml: ctypes.CDLL, base: ctypes.CDLL) -> tuple[GgmlDevice, ...]:
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_count.argtypes = []
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in (base.ggml_backend_dev_name, base.ggml_backend_dev_description):
        fn.restype = ctypes.c_char_p
        fn.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_memory.restype = None
    base.ggml_backend_dev_memory.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    devices = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        if not dev:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = base.ggml_backend_dev_type(dev)
        devices.append(
            GgmlDevice(
                index=i,
                name=(base.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
                description=(base.ggml_backend_dev_description(dev) or b"").decode(
                    "utf-8", "replace"
                ),
                type=_DEVICE_TYPES.get(kind, f"type{kind}"),
                memory_free=int(free.value),
                memory_total=int(total.value),
            )
        )
    return tuple(devices)
