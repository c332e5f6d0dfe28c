"""A LoRA request gives llama-server's tokens: the same base GGUF, the same adapter GGUF and
scale, greedy, one request at a time on each (the same batch shapes: the prompt in one batch,
then one token a step), one llama thread each. llama-server is the C++ server of the llama.cpp
our binding vendors (benchmarks/llama_server.py builds it once into the user cache); without
that binary the test is skipped."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from helpers import http

PROMPT = "tell me about the river and the old mill and why they matter"
# The last: every adapter at 0, the base model (an empty list would ask for the defaults).
SETS = (
    [{"id": 0, "scale": 0.5}],
    [{"id": 0, "scale": 1.0}],
    [{"id": 1, "scale": 0.75}, {"id": 0, "scale": 0.25}],
    [{"id": 0, "scale": 0}],
)


def _binary() -> Path:
    from benchmarks.llama_server import cached_binary

    binary = cached_binary(version("llama-cpp-python"))
    if not binary.is_file():
        pytest.skip(f"llama-server not built ({binary}; python -m benchmarks --with-llama-server builds it)")
    return binary


async def test_lora_output_equals_llama_servers(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, model_dir: Path, tmp_path: Path
) -> None:
    from benchmarks.llama_server import LlamaServer

    from hydra_trio.model.synthetic_lora import write_lora_adapter

    binary = _binary()
    adapters = [
        str(write_lora_adapter(tiny_model_ctx, model_dir / f"ctx-style-{i}.gguf", seed=10 + i)) for i in range(2)
    ]
    ep = await start_engine(
        tiny_model_ctx, lora=tuple(adapters), lora_init_without_apply=True, slots=1, ctx_size=2048, cache_ram_mib=0,
    )
    ours: list[list[int]] = []
    backend = ep.state.engine._core.backend
    async with http(ep) as h:
        for lora in SETS:
            r = await h.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "lora": lora,
                "cache_salt": f"fresh-{len(ours)}",  # the prompt computed whole, as llama-server's is
            })
            assert r.status_code == 200, r.text
            # The generated tokens, from the one slot's KV: all but the last (never evaluated).
            ours.append(backend.seq_tokens[0][r.json()["usage"]["prompt_tokens"] :])
    server = await trio.to_thread.run_sync(lambda: LlamaServer(
        binary, str(tiny_model_ctx), ctx=2048, slots=1, log_dir=tmp_path, tag="llama-server-lora", threads=1,
        extra=["--lora", ",".join(adapters)],
    ))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            listed = (await c.get("/lora-adapters")).json()
            assert [(a["id"], a["path"], a["scale"]) for a in listed] == [(0, adapters[0], 1.0), (1, adapters[1], 1.0)]
            theirs = []
            for lora in SETS:
                r = await c.post("/completion", json={
                    "prompt": PROMPT, "n_predict": 16, "temperature": 0, "ignore_eos": True, "lora": lora,
                    "cache_prompt": False, "return_tokens": True,
                })
                assert r.status_code == 200, r.text
                theirs.append(r.json()["tokens"])
    finally:
        await trio.to_thread.run_sync(server.stop)
    assert [len(t) for t in ours] == [15] * len(SETS)
    assert ours == [t[:15] for t in theirs]
    assert len({tuple(t) for t in theirs}) == len(SETS)  # each set its own tokens: the adapters did something
