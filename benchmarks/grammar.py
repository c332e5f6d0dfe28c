"""`python -m benchmarks.grammar [--preset small] [--tokens 64]`: constrained decoding's cost.

One engine in this process (the synthetic model, random weights), chat over loopback HTTP:
tok/s of greedy replies at 1 and 8 streams without a constraint and with a JSON schema
(response_format), each reply cut at the same length (``ignore_eos``, a string field that
need not close), so both count the same tokens; and a schema's compile, first and
cached. Random weights are the worst case for the grammar: the model's own pick is often
one the grammar refuses, so the whole vocabulary goes through the grammar that token.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import trio

from hydra_trio.config import Settings

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["title", "n"],
    "additionalProperties": False,
}
COMPILE_SCHEMA = {  # a larger schema for the compile figure
    "type": "object",
    "properties": {
        f"field_{i}": {"type": t}
        for i, t in enumerate(["string", "integer", "number", "boolean"] * 8)
    },
    "required": [f"field_{i}" for i in range(0, 32, 2)],
    "additionalProperties": False,
}


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


async def run_streams(base: str, n_streams: int, tokens: int, extra: dict[str, Any]) -> float:
    """Aggregate completion tok/s of ``n_streams`` concurrent greedy chats."""
    counts: list[int] = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        body = {
            "messages": [{"role": "user", "content": f"write a title {i}"}],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(r.text)
        counts.append(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await one(-1, client)  # warm: prompt paths, the grammar compiled
        counts.clear()
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n_streams):
                nursery.start_soon(one, i, client)
        wall = time.perf_counter() - t0
    return sum(counts) / wall


async def main(preset: str, tokens: int, threads: int) -> None:
    from hydra_trio.app import serve
    from hydra_trio.model.synthetic import write_model

    model = Path(tempfile.gettempdir()) / f"hydra-bench-{preset}.gguf"
    if not model.exists():
        write_model(model, preset, seed=0)
    settings = replace(
        Settings(model=str(model)), host="127.0.0.1", port=0, rpc_port=0, slots=8, ctx_size=8 * 512, threads=threads
    )
    async with trio.open_nursery() as nursery:
        ep = await nursery.start(serve, settings)
        base = f"http://127.0.0.1:{ep.http_port}"
        print(f"model {preset} ({ep.state.engine.n_vocab} vocab), {tokens} tokens a reply, {threads} threads")
        print(f"{'streams':>8} {'unconstrained tok/s':>20} {'json_schema tok/s':>18} {'ratio':>6}")
        for n in (1, 8):
            plain = await run_streams(base, n, tokens, {})
            constrained = await run_streams(base, n, tokens, {"response_format": response_format(SCHEMA)})
            print(f"{n:>8} {plain:>20.1f} {constrained:>18.1f} {constrained / plain:>6.2f}")
        inputs = ep.state.engine.inputs
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            await inputs.compile_grammar(inputs.generation_params({"response_format": response_format(COMPILE_SCHEMA)}))
            times.append((time.perf_counter() - t0) * 1000.0)
        print(f"compile of a 32-property schema: first {times[0]:.2f} ms, cached {times[1]:.3f} ms")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    trio.run(main, args.preset, args.tokens, args.threads)
