"""GPU-offload flags on a CPU-only machine: they parse, reach llama_model_params and
llama_context_params (context rebuilds and model reloads included), and the engine reports
the ggml devices and what llama.cpp applied. (No GPU here: the GPU path itself is unverified
by these tests.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from helpers import ENGINE, http, rpc, wait_slots_until
from hydra_trio import cli
from hydra_trio.config import settings_from
from hydra_trio.engine.llama import LlamaBackend, OffloadSettings
from hydra_trio.engine.llama.devices import flash_attn_applied, offloaded_layers, read_ggml_devices


@pytest.fixture
def llama_params(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """Records the params every model load and context creation really receives."""
    seen: dict[str, list[dict[str, Any]]] = {"model": [], "context": []}
    load, init = llama_cpp.llama_model_load_from_file, llama_cpp.llama_init_from_model

    def spy_load(path: bytes, params: Any) -> Any:
        seen["model"].append({"n_gpu_layers": params.n_gpu_layers, "main_gpu": params.main_gpu})
        return load(path, params)

    def spy_init(model: Any, params: Any) -> Any:
        seen["context"].append(
            {
                "flash_attn_type": params.flash_attn_type,
                "offload_kqv": params.offload_kqv,
                "n_ctx": params.n_ctx,
            }
        )
        return init(model, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", spy_load)
    monkeypatch.setattr(llama_cpp, "llama_init_from_model", spy_init)
    yield seen


def test_flags_and_env_parse() -> None:
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--n-gpu-layers",
            "-1",
            "--main-gpu",
            "1",
            "--flash-attn",
            "off",
            "--no-kv-offload",
        ]
    )
    s = settings_from(args, env={})
    assert (s.n_gpu_layers, s.main_gpu, s.flash_attn, s.no_kv_offload) == (-1, 1, "off", True)
    d = settings_from(cli.build_parser().parse_args(["serve"]), env={})
    assert (d.n_gpu_layers, d.main_gpu, d.flash_attn, d.no_kv_offload) == (None, 0, "auto", False)
    e = settings_from(
        None,
        env={"HYDRA_N_GPU_LAYERS": "12", "HYDRA_FLASH_ATTN": "on", "HYDRA_NO_KV_OFFLOAD": "true"},
    )
    assert (e.n_gpu_layers, e.flash_attn, e.no_kv_offload) == (12, "on", True)
    for bad in (
        {"HYDRA_FLASH_ATTN": "maybe"},
        {"HYDRA_N_GPU_LAYERS": "-2"},
        {"HYDRA_NO_KV_OFFLOAD": "perhaps"},
    ):
        with pytest.raises(SystemExit):
            settings_from(None, env=bad)


def test_default_layers_follow_the_build() -> None:
    assert OffloadSettings().resolved_gpu_layers(supports_offload=True) == -1
    assert OffloadSettings().resolved_gpu_layers(supports_offload=False) == 0
    assert OffloadSettings(n_gpu_layers=7).resolved_gpu_layers(supports_offload=False) == 7
    # llama.cpp's own count wins; without it, its rule.
    assert offloaded_layers(["load_tensors: offloaded 13/19 layers to GPU\n"], 19, True, -1) == 13
    assert offloaded_layers([], 19, True, -1) == 19
    assert offloaded_layers([], 19, True, 5) == 5
    assert offloaded_layers([], 19, False, -1) == 0
    assert flash_attn_applied(["llama_context: Flash Attention enabled"], "auto") == "on"
    assert flash_attn_applied(["Flash Attention not supported, set to disabled"], "auto") == "off"
    forced = "llama_init_from_model: enabling flash_attn since it is required for quantized V cache"
    assert flash_attn_applied([forced], "auto") == "on"
    assert flash_attn_applied([], "on") == "on"


def test_params_reach_llama_and_survive_a_rebuild(
    tiny_model: Path, llama_params: dict[str, list[dict[str, Any]]]
) -> None:
    offload = OffloadSettings(n_gpu_layers=2, main_gpu=0, flash_attn="off", kv_offload=False)
    b = LlamaBackend(
        str(tiny_model), n_slots=1, n_ctx=256, n_threads=1, n_batch=64, offload=offload
    )
    try:
        assert llama_params["model"] == [{"n_gpu_layers": 2, "main_gpu": 0}]
        assert llama_params["context"][-1] == {
            "flash_attn_type": 0,
            "offload_kqv": False,
            "n_ctx": 256,
        }
        b.rebuild_context(n_ctx=512)  # CONFIGURE T2
        assert llama_params["context"][-1] == {
            "flash_attn_type": 0,
            "offload_kqv": False,
            "n_ctx": 512,
        }
        report = b.offload
        assert report is not None
        assert report.n_gpu_layers_param == 2
        assert report.n_gpu_layers == (2 if b.gpu_offload_supported else 0)
        assert report.n_layers == b.info.n_layer + 1
        assert report.flash_attn == "off"
    finally:
        b.close()


def test_default_is_all_layers_when_the_build_can_offload(
    tiny_model: Path, llama_params: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    b = LlamaBackend(str(tiny_model), n_slots=1, n_ctx=256, n_threads=1, n_batch=64)
    try:
        assert llama_params["model"][-1]["n_gpu_layers"] == -1
        assert llama_params["context"][-1]["flash_attn_type"] == -1  # auto
        assert llama_params["context"][-1]["offload_kqv"] is True
    finally:
        b.close()


def test_ggml_devices_are_read_from_the_shared_libs() -> None:
    devices = read_ggml_devices()
    cpu = [d for d in devices if d.type == "cpu"]
    assert cpu, devices
    assert cpu[0].name and cpu[0].description
    assert cpu[0].memory_total > 0


async def test_engine_reports_offload_and_keeps_it_across_a_reload(
    start_engine: Callable[..., Any],
    tiny_model: Path,
    tiny_model_other: Path,
    llama_params: dict[str, list[dict[str, Any]]],
) -> None:
    ep = await start_engine(
        tiny_model, flash_attn="off", no_kv_offload=True, n_gpu_layers=3, **ENGINE
    )
    engine = ep.state.engine
    async with http(ep) as c:
        version = (await c.get("/version")).json()
    async with await rpc(ep) as r:
        info = (await r.info()).meta
        for body in (version, info):
            assert body["n_gpu_layers_requested"] == 3
            assert body["n_gpu_layers"] == (3 if engine._core.backend.gpu_offload_supported else 0)
            assert body["n_layers"] == engine._core.backend.info.n_layer + 1
            assert body["flash_attn"] == "off" and body["flash_attn_requested"] == "off"
            assert body["kv_offload"] is False
            assert any(d["type"] == "cpu" and d["memory_total"] > 0 for d in body["devices"])
            assert body["chat_template"]["source"] == "gguf"
        # CONFIGURE T3: the reloaded model gets the same offload settings.
        assert (await r.configure(0, {"model_path": str(tiny_model_other)})).ok
    await wait_slots_until(engine, lambda: engine._core.t3_reloads == 1)
    assert llama_params["model"][-1] == {"n_gpu_layers": 3, "main_gpu": 0}
    assert llama_params["context"][-1]["flash_attn_type"] == 0
    assert llama_params["context"][-1]["offload_kqv"] is False



def test_device_list_degrades_to_empty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A llama_cpp install without ggml libraries where we look, or a ggml without the device
    API, gives an empty list (the model still loads), not an error."""
    from hydra_trio.engine.llama import devices

    monkeypatch.setattr(devices, "_lib_dir", lambda: tmp_path)
    assert devices.read_ggml_devices() == ()
    monkeypatch.undo()

    def no_api(*_args: Any) -> Any:
        raise AttributeError("undefined symbol: ggml_backend_dev_count")

    monkeypatch.setattr(devices, "_list_devices", no_api)
    assert devices.read_ggml_devices() == ()
