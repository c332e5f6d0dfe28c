"""The engine on a GPU (``pytest -m gpu``): offload, greedy parity with CPU compute, KV
hand-offs between two engines on the one GPU and between a CPU engine and a GPU one, DELETE
of a GPU decode, --no-kv-offload and partial offload. Synthetic models only (no downloads).

Every test here is skipped, saying why, unless the installed llama.cpp build can offload
(``llama_cpp.llama_supports_gpu_offload()``) and ggml lists a GPU device: the default run on a
CPU machine is unaffected. benchmarks/gpu/run.sh builds a CUDA or Vulkan llama-cpp-python and
runs them; benchmarks/gpu/vulkan.sh does so on Mesa's lavapipe (docs/gpu.md, "The GPU check").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
import trio
import trio.testing

from helpers import (
    ENGINE,
    MESSAGES,
    OTHER_MESSAGES,
    chat_completion,
    decode_ok,
    entry_of,
    frame,
    gate,
    get_result,
    http,
    kv_meta,
    prefill,
    rpc,
    slot_meta,
    slot_tokens,
    store,
    text_of,
)
from hydra_trio.engine.llama.devices import _OFFLOADED_RE, read_ggml_devices
from hydra_trio.rpc.client import decode_call, state_get_call, state_put_call
from hydra_trio.wire import Status


def _skip_reason() -> str | None:
    if not llama_cpp.llama_supports_gpu_offload():
        return (
            "no GPU offload in this llama.cpp build (llama_cpp.llama_supports_gpu_offload() is "
            "False): the GPU tests need a CUDA or Vulkan build, see docs/gpu.md 'The GPU check'"
        )
    if not any(d.type in ("gpu", "igpu") for d in read_ggml_devices()):
        return "this llama.cpp build can offload, but ggml lists no GPU device on this machine"
    return None


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

# Greedy parity: the first N_PARITY tokens of the same prompt, evaluated whole on each engine.
N_PARITY = 8
# ggml moves a host-weight matmul to the GPU for batches of this many tokens or more
# (op offload); a shorter prompt keeps the --n-gpu-layers 0 engine on CPU compute.
OP_OFFLOAD_MIN_BATCH = 32
STOPPED_N = 64  # for a request held by the gate: more than it can generate before the DELETE
# The lane's flash-attention setting (benchmarks/gpu/run.sh sets HYDRA_FLASH_ATTN=off on
# lavapipe, whose flash-attention shader faults), for the CPU and GPU engines alike: their
# greedy text is compared.
LANE = {**ENGINE, **({"flash_attn": os.environ["HYDRA_FLASH_ATTN"]} if os.environ.get("HYDRA_FLASH_ATTN") else {})}
FULL = {"n_gpu_layers": -1, **LANE}


def _report(ep: Any) -> Any:
    report = ep.state.engine._core.backend.offload
    assert report is not None
    return report


async def _version(ep: Any) -> dict[str, Any]:
    async with http(ep) as h:
        r = await h.get("/version")
    assert r.status_code == 200, r.text
    return r.json()


async def _greedy(ep: Any, n: int = N_PARITY) -> dict[str, Any]:
    async with http(ep) as h:
        return await chat_completion(h, MESSAGES, n)


# ---- (a) every layer on the GPU -----------------------------------------------------------


async def test_all_layers_offloaded(
    start_engine: Callable[..., Any], tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """llama.cpp's own "offloaded N/N layers to GPU", the ``offload:`` log line, /version and
    INFO agree: every layer (n_layer + the output layer) is on the GPU."""
    caplog.set_level(logging.INFO, logger="hydra_trio")
    ep = await start_engine(tiny_model, **FULL)
    backend = ep.state.engine._core.backend
    n_layers = backend.info.n_layer + 1
    counts = [m.groups() for line in backend._load_log if (m := _OFFLOADED_RE.search(line))]
    assert counts == [(str(n_layers), str(n_layers))], backend._load_log
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("offload: ")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"offload: {n_layers}/{n_layers} layers on "), lines[0]
    assert ", 0 on CPU;" in lines[0] and "KV cache with its layers" in lines[0], lines[0]
    version = await _version(ep)
    async with await rpc(ep) as c:
        info = (await c.info()).meta
    for body in (version, info):
        assert body["gpu_offload_supported"] is True
        assert body["n_gpu_layers_requested"] == -1
        assert body["n_gpu_layers"] == body["n_layers"] == n_layers
        assert body["kv_offload"] is True
        gpus = [d for d in body["devices"] if d["type"] in ("gpu", "igpu")]
        assert gpus and gpus[0]["memory_total"] > 0, body["devices"]
    assert (await _greedy(ep))["usage"]["completion_tokens"] > 0


# ---- (b) greedy text: GPU compute vs CPU compute in the same build ----------------------------


async def test_greedy_text_matches_cpu_compute(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """The first 8 greedy tokens of MESSAGES (prompt evaluated whole, fresh engines, no cache)
    with every layer on the GPU equal those of --n-gpu-layers 0 in the same CUDA build (CPU
    compute: weights and KV on the host; the prompt is under ggml's op-offload batch size, so
    no matmul is moved to the GPU). tiny_model_ctx's text depends on the whole context."""
    cpu = await start_engine(tiny_model_ctx, n_gpu_layers=0, **LANE)
    gpu = await start_engine(tiny_model_ctx, **FULL)
    assert _report(cpu).n_gpu_layers == 0
    assert _report(gpu).n_gpu_layers == _report(gpu).n_layers
    ref, out = await _greedy(cpu), await _greedy(gpu)
    assert ref["usage"]["prompt_tokens"] < OP_OFFLOAD_MIN_BATCH, ref["usage"]
    assert ref["usage"]["completion_tokens"] == N_PARITY, ref  # no early stop: 8 tokens compared
    assert out["usage"] == ref["usage"]
    assert text_of(out) == text_of(ref), (text_of(out), text_of(ref))


# ---- (c) STATE_GET/PUT and a DECODE hand-off between two engines on the one GPU -------------


async def test_state_get_put_between_two_gpu_engines(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """A's slot (KV in GPU memory) read with STATE_GET, written into B's slot with STATE_PUT:
    B holds the same tokens, and continuing there gives A's greedy text."""
    a = await start_engine(tiny_model_ctx, **FULL)
    b = await start_engine(tiny_model_ctx, **FULL)
    async with http(a) as ha, http(b) as hb, await rpc(a) as ca, await rpc(b) as cb:
        want = await chat_completion(ha, MESSAGES, 16)
        await prefill(ca, 0, MESSAGES)
        tokens = await slot_tokens(ca, 0)
        got = await ca.call(state_get_call(0))
        assert got.ok and got.meta["n_past"] == len(tokens) > 0
        blob = bytes(got.payload)
        put = await cb.call(state_put_call(1, blob), check=False)
        assert put.status == Status.OK, put.meta
        assert await slot_tokens(cb, 1) == tokens
        assert (await slot_meta(cb, 1))["n_past"] == len(tokens)
        rid = await decode_ok(cb, 1, frame(MESSAGES, n_predict=16))  # no KV: continue the slot
        body = await get_result(hb, rid)
    assert text_of(body) == text_of(want)
    # The slot's KV was reused (a STATE_PUT blob has no logits: the last position may be
    # evaluated again).
    assert body["hydra_metrics"]["n_common"] >= len(tokens) - 1
    assert body["hydra_metrics"]["n_prompt_processed"] <= 1


async def test_decode_handoff_between_two_gpu_engines(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """PREFILL on A, DECODE with that KV on B (both fully offloaded): B restores every prompt
    position, evaluates none, and says what A says."""
    a = await start_engine(tiny_model_ctx, **FULL)
    b = await start_engine(tiny_model_ctx, **FULL)
    async with http(a) as ha, http(b) as hb, await rpc(a) as ca, await rpc(b) as cb:
        want = await chat_completion(ha, MESSAGES, 16)
        pre = await prefill(ca, 0, MESSAGES)
        n_past = pre.meta["n_past"]
        rid = await decode_ok(cb, 1, frame(MESSAGES, pre.payload, n_predict=16, kv_metadata=kv_meta(pre)))
        body = await get_result(hb, rid)
    m = body["hydra_metrics"]
    assert text_of(body) == text_of(want)
    for key in ("prompt_tokens", "completion_tokens"):
        assert body["usage"][key] == want["usage"][key]
    assert m["n_common"] == n_past and m["n_prompt_processed"] == 0 and m["logits_reused"] is True
    assert m["kv_bytes"] == len(pre.payload) and m["restore_slot_ms"] > 0


async def test_decode_handoff_between_cpu_and_gpu_engines(
    start_engine: Callable[..., Any], tiny_model_ctx: Path
) -> None:
    """PREFILL on a CPU engine (--n-gpu-layers 0), DECODE on a fully offloaded one, then the
    way back: the identity gate lets the same model's KV through whichever backend made it
    (and refuses another model's name on the GPU engine), every prompt position is restored
    and none evaluated, and the text is that of CPU compute for the first 8 tokens."""
    cpu = await start_engine(tiny_model_ctx, n_gpu_layers=0, **LANE)
    gpu = await start_engine(tiny_model_ctx, **FULL)
    assert _report(cpu).n_gpu_layers == 0 and _report(gpu).n_gpu_layers == _report(gpu).n_layers
    ref = await _greedy(cpu)
    assert ref["usage"]["completion_tokens"] == N_PARITY
    for src, dst in ((cpu, gpu), (gpu, cpu)):
        async with http(dst) as hd, await rpc(src) as cs, await rpc(dst) as cd:
            pre = await prefill(cs, 0, MESSAGES)
            n_past = pre.meta["n_past"]
            if dst is gpu:
                other = {**kv_meta(pre), "model_name": "Other Tiny", "model_alias": "other-tiny"}
                refused = await cd.call(
                    decode_call(1, frame(MESSAGES, pre.payload, n_predict=N_PARITY, kv_metadata=other)), check=False
                )
                assert refused.status == Status.ERROR and refused.meta["error_code"] == "CAP_MISMATCH", refused.meta
            rid = await decode_ok(cd, 1, frame(MESSAGES, pre.payload, n_predict=N_PARITY, kv_metadata=kv_meta(pre)))
            body = await get_result(hd, rid)
        m = body["hydra_metrics"]
        assert m["n_common"] == n_past and m["n_prompt_processed"] == 0 and m["logits_reused"] is True, m
        assert m["kv_bytes"] == len(pre.payload)
        # The same counts as CPU compute's, the restored prompt reported as cached (none computed)
        usage, want = body["usage"], ref["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            want["prompt_tokens"],
            want["completion_tokens"],
        )
        assert usage["prompt_tokens_details"]["cached_tokens"] == n_past, usage
        assert text_of(body) == text_of(ref), (src is cpu, text_of(body), text_of(ref))


# ---- (d) DELETE interrupts a GPU decode -----------------------------------------------------


async def test_delete_interrupts_a_gpu_decode(start_engine: Callable[..., Any], tiny_model: Path) -> None:
    """As tests/decode/test_decode_lifecycle.py's token-loop DELETE, on the GPU: the decode is paused
    by holding the GPU worker, DELETEd mid-generation, and after the DELETE reply not one more
    token is generated (checked after an identical request ran to its end)."""
    ep = await start_engine(tiny_model, **FULL)
    engine = ep.state.engine
    async with http(ep) as h, await rpc(ep) as c:
        async with trio.open_nursery() as nursery, gate(ep) as g:
            rid = await decode_ok(c, 0, frame(MESSAGES, n_predict=STOPPED_N))
            entry = entry_of(ep, rid)
            await g.step(2)  # tokenize, prefill (samples the first token)
            await g.step(5)  # five generation steps
            await g.wait_queued(1)
            res = entry.result
            assert entry.state.value == "generating" and 5 <= res.completion_tokens < STOPPED_N
            replies: list[Any] = []

            async def delete() -> None:
                replies.append(await h.delete(f"/v1/decode/{rid}"))

            nursery.start_soon(delete)
            await trio.testing.wait_all_tasks_blocked()
            assert entry.task.scope.cancel_called
            g.open()
        # After the DELETE reply:
        (d,) = replies
        assert d.status_code == 200, d.text
        assert d.json()["cancelled"] is True and d.json()["state"] == "cancelled"
        count, generated, n_past = res.completion_tokens, engine._core.tokens_generated, engine._core.n_past(0)
        other = await decode_ok(c, 1, frame(MESSAGES, n_predict=STOPPED_N))
        body = await get_result(h, other)
        assert body["usage"]["completion_tokens"] > count
        assert res.completion_tokens == count  # 0 tokens after the DELETE
        assert engine._core.tokens_generated == generated + body["usage"]["completion_tokens"]
        assert engine._core.n_past(0) == n_past
        assert store(ep).get(rid).state.value == "cancelled"
        assert text_of(body).startswith(res.text)


# ---- (e) --no-kv-offload and partial offload ------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "kv_offload"),
    [({"n_gpu_layers": -1, "no_kv_offload": True}, False), ({"n_gpu_layers": 1}, True)],
    ids=["no-kv-offload", "one-layer"],
)
async def test_no_kv_offload_and_partial_offload(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, settings: dict[str, Any], kv_offload: bool
) -> None:
    """The engine serves with the KV cache in host memory, and with one layer on the GPU; a
    hand-off (PREFILL, DECODE on the other slot) works in each, and the text is that of CPU
    compute for the first 8 tokens."""
    cpu = await start_engine(tiny_model_ctx, n_gpu_layers=0, **LANE)
    ep = await start_engine(tiny_model_ctx, **settings, **LANE)
    report = _report(ep)
    want_layers = report.n_layers if settings["n_gpu_layers"] == -1 else 1
    assert report.n_gpu_layers == want_layers
    version = await _version(ep)
    assert version["n_gpu_layers"] == want_layers and version["kv_offload"] is kv_offload
    ref, out = await _greedy(cpu), await _greedy(ep)
    assert out["usage"]["completion_tokens"] == N_PARITY
    assert text_of(out) == text_of(ref)
    async with http(ep) as h, await rpc(ep) as c:
        pre = await prefill(c, 0, OTHER_MESSAGES)
        rid = await decode_ok(c, 1, frame(OTHER_MESSAGES, pre.payload, n_predict=N_PARITY, kv_metadata=kv_meta(pre)))
        body = await get_result(h, rid)
        plain = await chat_completion(h, OTHER_MESSAGES, N_PARITY)
    assert text_of(body) == text_of(plain)
    assert body["hydra_metrics"]["n_prompt_processed"] == 0
