"""`python -m benchmarks.grammar [--model gemma3-270m|synthetic] [--rounds 3] [--tokens 64]
[--with-llama-server | --llama-server PATH]`: constrained decoding's cost.

Each engine in its own process (hydra-trio serve, and llama.cpp's llama-server as the peer,
same model, slots, threads and context), text completions over loopback HTTP: aggregate tok/s
of greedy replies at 1 and 8 streams, without a constraint and with the same JSON schema in
llama-server's ``json_schema`` field (both engines take it), every reply cut at the same
length (``ignore_eos`` unconstrained; the schema's string is longer than the reply). Each
round runs the cases back to back and the ratios are taken within the round; every round is
printed. The same schema's grammar is also sent as ``grammar`` (a client's own GBNF: ours runs
it on llguidance, llama-server on llama.cpp's engine). Then the compile of a schema and of a tools grammar, first and
cached (hydra-trio only: llama-server has no such figure).

The real model (Gemma 3 270M, 262k vocabulary) is the figure that matters: random synthetic
weights are the worst case (the model's own pick is often refused, so the whole vocabulary
goes through the grammar that token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from .harness import EngineProcess

# The title's minLength keeps every reply open past --tokens, so both engines count the same
# tokens without ignore_eos (llama-server fails a request whose grammar ends under it).
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "minLength": 400}, "n": {"type": "integer"}},
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
TOOLS = [  # eight tools of four parameters each, for the tools grammar's compile figure
    {"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"},
                       "d": {"type": "number"}},
        "required": ["a", "b"],
    }}}
    for i in range(8)
]
STREAMS = (1, 8)


async def run_streams(base: str, n_streams: int, tokens: int, extra: dict[str, Any]) -> float:
    """Aggregate completion tok/s of ``n_streams`` concurrent greedy text completions."""
    counts: list[int] = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        body = {
            "prompt": f"A short title for story number {i}, as JSON:",
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
        r = await client.post("/v1/completions", json=body)
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


def measure_rounds(
    servers: dict[str, str], cases: dict[str, dict[str, Any]], streams: Sequence[int], rounds: int, tokens: int,
    report: Callable[[dict[str, Any]], None] = lambda _row: None,
) -> list[dict[str, Any]]:
    """Aggregate tok/s of every case on every server at each stream count, ``rounds`` times:
    one row a round (``{server}_{case}_{n}``, and ``round`` from 1), so ratios are taken within
    a round. The servers' order alternates between rounds (this VM's speed drifts by minutes:
    a fixed order would charge the drift to one side); ``report`` sees each row when done."""
    out: list[dict[str, Any]] = []
    for r in range(rounds):
        row: dict[str, Any] = {"round": r + 1}
        order = list(servers.items())
        for n in streams:
            for server, url in order if r % 2 == 0 else order[::-1]:
                for case, extra in cases.items():
                    row[f"{server}_{case}_{n}"] = trio.run(run_streams, url, n, tokens, extra)
        out.append(row)
        report(row)
    return out


async def request_grammar(inputs: Any, body: dict[str, Any]) -> Any:
    """The grammar a chat request's plan writes (engine/inputs.py ``Inputs``: its parameters,
    then the chat side's one decision), not compiled: as ``Engine.prepare`` makes it."""
    return (await inputs.plan(body, inputs.generation_params(body))).grammar


def compile_figures(model: str, threads: int) -> dict[str, list[float]]:
    """ms of a 32-property schema's and an 8-tool grammar's making and compile, first then
    cached, in an engine of this process (what the figure times is the request's grammar, not
    the HTTP path)."""
    from dataclasses import replace

    from hydra_trio.app import serve
    from hydra_trio.config import Settings

    out: dict[str, list[float]] = {}

    async def main() -> None:
        settings = replace(
            Settings(model=model), host="127.0.0.1", port=0, rpc_port=0, slots=1, ctx_size=2048, threads=threads
        )
        async with trio.open_nursery() as nursery:
            ep = await nursery.start(serve, settings)
            inputs = ep.state.engine._core.inputs
            messages = [{"role": "user", "content": "x"}]
            cases = {
                "schema (32 properties)": {
                    "messages": messages,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": COMPILE_SCHEMA}},
                },
                "tools (8, required)": {"messages": messages, "tools": TOOLS, "tool_choice": "required"},
                "tools (8, auto: lazy)": {"messages": messages, "tools": TOOLS, "tool_choice": "auto"},
            }
            for name, body in cases.items():
                times = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    await inputs.compile_grammar(await request_grammar(inputs, body))
                    times.append((time.perf_counter() - t0) * 1000.0)
                out[name] = times
            nursery.cancel_scope.cancel()

    trio.run(main)
    return out


def trigger_figures(model: str, tokens: int = 3500) -> dict[str, list[float]]:
    """us a token of the sampler over a free-text reply of ``tokens`` tokens (the first and
    the last 200), with tool_choice auto's lazy grammar waiting for its trigger and with no
    grammar: the trigger check should cost what the new text costs, not grow with the reply
    (llama.cpp searches its whole buffer each token; engine/structured/triggers.py TriggerWatch)."""
    from dataclasses import replace

    import numpy as np

    from hydra_trio.app import serve
    from hydra_trio.config import Settings
    from hydra_trio.engine.sample import Sampler

    out: dict[str, list[float]] = {}

    async def main() -> None:
        settings = replace(
            Settings(model=model), host="127.0.0.1", port=0, rpc_port=0, slots=1, ctx_size=2048, threads=1
        )
        async with trio.open_nursery() as nursery:
            ep = await nursery.start(serve, settings)
            core = ep.state.engine._core
            backend = core.backend
            lazy = (
                await ep.state.engine.prepare(
                    "chat", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "auto"}
                )
            ).params
            word = backend.tokenize(" word", add_special=False, parse_special=False)[-1]

            def run(params: Any) -> list[float]:
                sampler = Sampler(params, grammars=core.inputs.grammars)
                eog = np.fromiter(sorted(backend.eog_ids), dtype=np.intp)
                logits = np.zeros(backend.info.n_vocab, dtype=np.float32)
                logits[word] = 10.0
                times = []
                try:
                    for _ in range(tokens):
                        row = logits.copy()
                        t0 = time.perf_counter()
                        sampler.sample(row, eog)
                        times.append(time.perf_counter() - t0)
                finally:
                    backend.retire(sampler)
                return [statistics.mean(times[:200]) * 1e6, statistics.mean(times[-200:]) * 1e6]

            out["auto (lazy, waiting)"] = await core.worker.call(lambda: run(lazy.sampling))
            out["no grammar"] = await core.worker.call(lambda: run(replace(lazy.sampling, grammar=None)))
            nursery.cancel_scope.cancel()

    trio.run(main)
    return out


def schema_as_gbnf() -> str:
    """SCHEMA as GBNF (llama-cpp-python's converter, here only), to send as a client's own
    grammar to both servers."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(json.dumps(SCHEMA))


def resolve_model(name: str) -> str:
    if name == "synthetic":
        from hydra_trio.model.synthetic import write_model

        path = Path(tempfile.gettempdir()) / "hydra-bench-small.gguf"
        if not path.exists():
            write_model(path, "small", seed=0)
        return str(path)
    if name.endswith(".gguf"):
        return name
    from hydra_trio.model.registry import named_model_path

    return str(named_model_path(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m", help="gemma3-270m (default), synthetic, or a GGUF path")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="llama threads of each engine (1: the fastest on 2 cores)")
    ap.add_argument("--with-llama-server", action="store_true", help="build llama-server once if needed and compare")
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every round's figures here")
    args = ap.parse_args()

    from .llama_server import LlamaServer, find_or_build

    model = resolve_model(args.model)
    binary = find_or_build(args.llama_server, args.with_llama_server)
    slots, ctx = 8, 8 * 512
    log_dir = Path(tempfile.mkdtemp(prefix="bench-grammar-"))
    schema = {"json_schema": SCHEMA, "ignore_eos": False}
    # The same schema's grammar sent as a client's own GBNF: ours runs it on llguidance
    # (engine/structured/guidance.py, GuidanceCache), llama-server on llama.cpp's grammar engine.
    gbnf = {"grammar": schema_as_gbnf(), "ignore_eos": False}
    print(f"model {args.model}, {args.tokens} tokens a reply, "
          f"{args.threads} thread(s) each, {slots} slots; logs in {log_dir}")
    ours = EngineProcess(model, slots=slots, ctx_size=ctx, threads=args.threads).start(log_dir, "hydra")
    peer = (
        LlamaServer(binary, model, ctx=ctx, slots=slots, log_dir=log_dir, tag="llama-server", threads=args.threads)
        if binary
        else None
    )
    try:
        servers = {"ours": ours.url} | ({"peer": peer.url} if peer is not None else {})

        def report(row: dict[str, Any]) -> None:
            r = row["round"] - 1
            for n in STREAMS:
                line = (f"round {r + 1}, {n} stream(s): ours {row[f'ours_plain_{n}']:.1f} plain, "
                        f"{row[f'ours_schema_{n}']:.1f} schema, "
                        f"{row[f'ours_gbnf_{n}']:.1f} gbnf (constrained/plain "
                        f"{row[f'ours_schema_{n}'] / row[f'ours_plain_{n}']:.2f})")
                if peer is not None:
                    line += (f"; llama-server {row[f'peer_plain_{n}']:.1f} "
                             f"plain, {row[f'peer_schema_{n}']:.1f} schema, "
                             f"{row[f'peer_gbnf_{n}']:.1f} gbnf; ours/llama-server with the schema "
                             f"{row[f'ours_schema_{n}'] / row[f'peer_schema_{n}']:.2f}, with the gbnf "
                             f"{row[f'ours_gbnf_{n}'] / row[f'peer_gbnf_{n}']:.2f}")
                print(line, flush=True)

        rounds = measure_rounds(
            servers, {"plain": {}, "schema": schema, "gbnf": gbnf}, STREAMS, args.rounds, args.tokens, report
        )
    finally:
        ours.stop()
        if peer is not None:
            peer.stop()
    print("medians of the per-round ratios:")
    for n in STREAMS:
        own = statistics.median(x[f"ours_schema_{n}"] / x[f"ours_plain_{n}"] for x in rounds)
        line = f"  {n} stream(s): constrained/plain {own:.2f}"
        line += (
            ", gbnf (llguidance)/plain "
            f"{statistics.median(x[f'ours_gbnf_{n}'] / x[f'ours_plain_{n}'] for x in rounds):.2f}"
        )
        if peer is not None:
            vs = statistics.median(x[f"ours_schema_{n}"] / x[f"peer_schema_{n}"] for x in rounds)
            vg = statistics.median(x[f"ours_gbnf_{n}"] / x[f"peer_gbnf_{n}"] for x in rounds)
            line += f", ours/llama-server constrained {vs:.2f}, gbnf {vg:.2f}"
        print(line)
    compiles = compile_figures(model, args.threads)
    for name, (first, cached) in compiles.items():
        print(f"compile of a {name} grammar: first {first:.2f} ms, cached {cached:.3f} ms")
    triggers = trigger_figures(model)
    for name, (first, last) in triggers.items():
        print(f"sampler over a 3,500-token free-text reply, {name}: {first:.0f} us a token (first 200), {last:.0f} us "
              "(last 200)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": args.model,
                    "tokens": args.tokens,
                    "rounds": rounds,
                    "compile_ms": compiles,
                    "trigger_us": triggers,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
