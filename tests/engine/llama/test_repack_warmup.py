"""Weights repacking (--repack/--no-repack, decided from the CPU by default: never on AMX,
whose llama.cpp kernels crash on repacked weights) and the warm-up at load (a kernel that
faults does so at start, before /health says ok)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from helpers import http, rpc
from hydra_trio.cli import build_parser
from hydra_trio.config import settings_from
from hydra_trio.engine.llama import LlamaBackend
from hydra_trio.engine.llama.devices import RepackChoice, cpu_flags, repack_choice

# /proc/cpuinfo lines of the two kinds of machine the suite runs on.
SAPPHIRE_RAPIDS_FLAGS = "fpu vme avx2 avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8 arch_lbr"
EPYC_FLAGS = "fpu vme avx2 avx512f avx512_bf16 avx512_vnni clzero"


def test_cpu_flags_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {SAPPHIRE_RAPIDS_FLAGS}\n\n"
                    "processor\t: 1\n")
    assert {"amx_tile", "amx_int8", "avx2"} <= cpu_flags(str(info))
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()


def test_repack_is_off_by_default_on_amx_and_on_elsewhere() -> None:
    amx = frozenset(SAPPHIRE_RAPIDS_FLAGS.split())
    epyc = frozenset(EPYC_FLAGS.split())
    off = repack_choice(None, amx)
    assert not off.enabled
    assert "AMX" in off.reason and "amx_int8" in off.reason and "--repack" in off.reason
    assert repack_choice(None, epyc) == RepackChoice(True, "on by default (no AMX on this CPU)")
    assert repack_choice(None, frozenset()).enabled  # no /proc/cpuinfo (macOS): no AMX either


def test_the_operator_s_word_wins() -> None:
    amx = frozenset(SAPPHIRE_RAPIDS_FLAGS.split())
    forced = repack_choice(True, amx)
    assert forced.enabled and "crash" in forced.reason  # allowed, with the warning in its reason
    assert repack_choice(False, frozenset(EPYC_FLAGS.split())) == RepackChoice(False, "--no-repack given")


def test_repack_and_warmup_flags_and_variables() -> None:
    parser = build_parser()
    assert settings_from(parser.parse_args(["serve", "--no-repack"]), env={}).repack is False
    assert settings_from(parser.parse_args(["serve", "--repack"]), env={}).repack is True
    assert settings_from(parser.parse_args(["serve"]), env={}).repack is None  # decided from the CPU
    assert settings_from(parser.parse_args(["serve", "--no-warmup"]), env={}).warmup is False
    assert settings_from(parser.parse_args(["serve"]), env={"HYDRA_REPACK": "0"}).repack is False
    with pytest.raises(SystemExit, match="HYDRA_REPACK: expected a boolean"):
        settings_from(parser.parse_args(["serve"]), env={"HYDRA_REPACK": "sometimes"})


@pytest.mark.parametrize("repack", [False, True])
async def test_repack_reaches_llama_cpp_and_is_reported(
    start_engine: Callable[..., Any], tiny_model: Path, repack: bool
) -> None:
    if repack and not repack_choice(None, cpu_flags()).enabled:
        pytest.skip("this CPU has AMX: repacked weights would crash llama.cpp here")
    ep = await start_engine(tiny_model, repack=repack)
    engine = ep.state.engine
    assert engine._core.backend.model_params_applied["use_extra_bufts"] is repack
    reason = "--repack given" if repack else "--no-repack given"
    async with http(ep) as h:
        version = (await h.get("/version")).json()
    assert (version["repack_requested"], version["repack"], version["repack_reason"]) == (repack, repack, reason)
    async with await rpc(ep) as c:
        info = await c.info()
    assert (info.meta["repack"], info.meta["repack_reason"]) == (repack, reason)


async def test_the_default_follows_this_cpu(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model)
    expected = repack_choice(None, cpu_flags())
    assert ep.state.engine._core.backend.repack == expected
    assert ep.state.engine._core.backend.model_params_applied["use_extra_bufts"] is expected.enabled


async def test_warmup_runs_at_load_and_leaves_nothing_behind(
    start_engine: Callable[..., Any], tiny_model: Path
) -> None:
    ep = await start_engine(tiny_model)
    engine = ep.state.engine
    assert engine._core.warmup_ms is not None and engine._core.warmup_ms > 0
    assert engine._core.backend.decode_s == 0.0  # the warm-up's compute is not users' compute
    assert [engine._core.backend.n_past(s) for s in range(engine._core.backend.n_slots)] == [0, 0]
    # The KV cache holds nothing of the warm-up: a slot's first request starts at position 0.
    pos_max = await engine._core.worker.call(
        lambda: __import__("llama_cpp").llama_memory_seq_pos_max(engine._core.backend._mem, 0)
    )
    assert pos_max == -1


async def test_no_warmup_skips_it(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, warmup=False)
    assert ep.state.engine._core.warmup_ms is None


async def test_a_warmup_that_fails_stops_the_start_before_health_is_ok(
    run_engine: Callable[..., Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def faulting(self: LlamaBackend) -> None:
        calls.append(self.n_slots)
        raise RuntimeError("kernel fault in warm-up")

    monkeypatch.setattr(LlamaBackend, "warmup", faulting)
    with pytest.raises(BaseException) as caught:  # trio may wrap it in a group
        with trio.fail_after(60):
            async with run_engine(tiny_model):
                pytest.fail("the engine started although its warm-up failed")
    assert "kernel fault in warm-up" in repr(caught.value)
    assert calls == [2]


def test_repacked_bytes_read_from_the_load_log() -> None:
    from hydra_trio.engine.llama.devices import repacked_mib

    lines = [
        "load_tensors:   CPU_Mapped model buffer size =   235.16 MiB",
        "load_tensors:   CPU_REPACK model buffer size =    12.66 MiB",
    ]
    assert repacked_mib(lines) == pytest.approx(12.66)
    assert repacked_mib(lines[:1]) == 0.0


@pytest.mark.realmodel
@pytest.mark.slow
def test_gemma_q4_k_weights_are_repacked_only_when_asked(gemma_model: Path) -> None:
    from hydra_trio.engine.llama import OffloadSettings

    if not repack_choice(None, cpu_flags()).enabled:
        pytest.skip("this CPU has AMX: repacked weights would crash llama.cpp here")
    for repack in (True, False):
        backend = LlamaBackend(
            str(gemma_model), n_slots=1, n_ctx=512, n_threads=1, offload=OffloadSettings(repack=repack)
        )
        try:
            backend.warmup()
            assert backend.offload is not None
            assert (backend.offload.repacked_mib > 0) is repack, backend.offload.summary()
        finally:
            backend.close()


async def test_on_an_amx_cpu_the_engine_loads_without_repacking(
    start_engine: Callable[..., Any], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default an AMX machine gets (its /proc/cpuinfo flags, read where the backend
    decides): no repacked weights reach llama.cpp, and /version says why."""
    from hydra_trio.engine.llama import context

    monkeypatch.setattr(context, "cpu_flags", lambda: frozenset(SAPPHIRE_RAPIDS_FLAGS.split()))
    ep = await start_engine(tiny_model)
    backend = ep.state.engine._core.backend
    assert backend.model_params_applied["use_extra_bufts"] is False
    async with http(ep) as h:
        version = (await h.get("/version")).json()
        r = await h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert version["repack"] is False and "AMX" in version["repack_reason"] and version["repacked_mib"] == 0.0
    assert r.status_code == 200, r.text


# ---- the C allocator: llama.cpp's smaller buffers from glibc's heap (docs/performance.md) ----


def _in_heap(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_buffers_up_to_32_mib_come_from_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    from hydra_trio.engine.llama import devices

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not Path("/proc/self/maps").exists():
        pytest.skip("glibc on Linux only")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert devices._set_heap_threshold() == "blocks up to 32 MiB from the heap (mmap threshold)"
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    small, large = libc.malloc(24 << 20), libc.malloc(40 << 20)  # a 30 MiB SWA cache; a 36 MiB KV
    try:
        assert _in_heap(small)
        assert not _in_heap(large)  # above the threshold: its own mapping, as before
    finally:
        libc.free(small)
        libc.free(large)


def test_an_operator_s_malloc_setting_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from hydra_trio.engine.llama import devices

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert devices._set_heap_threshold() == "the operator's mmap threshold"
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert devices._set_heap_threshold() == "the operator's mmap threshold"
