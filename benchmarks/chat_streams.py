"""Concurrent streamed chats on the ``bench`` preset against llama-server, round for round;
with ``--base`` (repeatable), other checkouts of the project beside this one in every round
(the bisection of issue 53's 8-stream regression, and the figure that shows the next one).

    python -m benchmarks.chat_streams [--streams 8] [--rounds 8] [--tokens 48] [--words 40]
        [--base /path/to/other/checkout ...] [--llama-server PATH | --with-llama-server]
        [--out benchmarks/results/chat-streams.json]

Each round sends the same ``--streams`` chats (``--words``-word prompts new to every server,
greedy, ``ignore_eos``, ``--tokens`` tokens each, streamed) to every server at once, one
server after the other, the order turning by one each round; every server has ``--streams``
slots and the same llama threads. Per server and round: aggregate tok/s from the requests'
start to the last token, ITL, and the server's CPU per streamed token (all threads; and the
trio thread's for hydra-trio): CPU time is far steadier than wall time on a busy machine, so a
change in the engine's own work per token shows there first; for hydra-trio also its steps
(llama_decode calls of the generation steps) and tokens per step, which say how well the
round's requests were batched, whatever the machine's load. Printed: each ratio per round (each checkout / llama-server,
this / each base) as median [min-max]: the figure to read on a shared VM, where both sides of a
ratio meet the same noise. A base is named by its folder's name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from hydra_trio.config import Settings
from hydra_trio.testing.sse_reader import delta_text, sse_chunk

from .ceiling import cpu_s, thread_cpu_s
from .harness import EngineProcess, env_info, metric_value, percentile, summary, words_prompt
from .llama_server import LlamaServer, find_or_build

HERE = Path(__file__).resolve().parent.parent
# hydra-trio's counters read around each round: how it batched the round's work
COUNTERS = {
    "steps": "hydra_step_batches_total",
    "step_tokens": "hydra_engine_step_tokens_total",
    "decode_s": "hydra_llama_decode_seconds_total",
    "worker_busy_s": "hydra_gpu_worker_busy_seconds_total",
}


async def _one(http: httpx.AsyncClient, prompt: str, n_tokens: int) -> list[float]:
    body = {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": n_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }
    times: list[float] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            chunk = sse_chunk(line)
            if chunk is not None and delta_text(chunk):
                times.append(time.perf_counter())
    return times


async def _streams(url: str, prompts: list[str], n_tokens: int) -> dict[str, Any]:
    results: list[list[float]] = [[] for _ in prompts]
    limits = httpx.Limits(max_connections=len(prompts) + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            results[i] = await _one(http, prompts[i], n_tokens)

        async with trio.open_nursery() as n:
            for i in range(len(prompts)):
                n.start_soon(one, i)
    tokens = sum(len(s) for s in results)
    end = max(s[-1] for s in results if s)
    gaps = [(s[i] - s[i - 1]) * 1e3 for s in results for i in range(1, len(s))]
    return {
        "tokens": tokens,
        "tok_s": tokens / (end - t0),
        "ttft_ms_max": max((s[0] - t0) * 1e3 for s in results if s),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
    }


def prompts_for(rnd: int, n: int, words: int) -> list[str]:
    """New to every server: the tag that makes a prompt new comes first (slots keep what
    they held, and a shared prefix would be reused)."""
    return [f"{chr(97 + rnd % 26)}"
            f"{chr(97 + i % 26)}{rnd} " + words_prompt(words, seed=10_000 * rnd + i) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chat_streams", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--words", type=int, default=40)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--threads", type=int, default=Settings().threads, help="llama threads of every server (default: "
                    "the engine's own default here, %(default)s)")
    ap.add_argument("--base", type=Path, action="append", default=[], help="another checkout (its src/ is used), run "
                    "beside this one; repeatable")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="a llama-server binary")
    ap.add_argument("--with-llama-server", action="store_true", help="build llama-server once if needed (~10 min)")
    ap.add_argument("--no-llama-server", action="store_true", help="only this checkout (and --base)")
    ap.add_argument("--extra", default="", help="more `hydra-trio serve` flags for this checkout's engine")
    ap.add_argument("--skip-this", action="store_true", help="only the --base checkouts "
                    "(and llama-server): a bisection")
    ap.add_argument("--out", type=Path, default=None, help="write the rows and ratios as JSON")
    args = ap.parse_args(argv)
    for base in args.base:
        if not (base / "src" / "hydra_trio").is_dir():
            ap.error(f"--base {base}: no src/hydra_trio there")
    if len({b.name for b in args.base} | {"this"}) != len(args.base) + 1:
        ap.error("--base: each checkout's folder needs its own name (not 'this')")
    if args.streams < 1 or args.rounds < 1 or args.tokens < 2:
        ap.error("--streams and --rounds must be at least 1, --tokens at least 2")
    peer_bin = None if args.no_llama_server else find_or_build(args.llama_server, args.with_llama_server)
    if peer_bin is None and not args.base and not args.no_llama_server:
        ap.error("no llama-server (give --llama-server PATH or "
                 "--with-llama-server) and no --base: nothing to compare with")
    from .__main__ import build_models

    cache = Path.home() / ".cache" / "hydra-trio" / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    model = build_models(cache, [args.preset])[args.preset]
    work = Path(tempfile.mkdtemp(prefix="hydra-chat-streams-"))
    slot_ctx = 512
    ctx = args.streams * slot_ctx
    servers: dict[str, str] = {}
    pids: dict[str, int] = {}
    stop: list[Any] = []
    before = os.environ.get("PYTHONPATH")
    try:
        versions = ([] if args.skip_this else [("this", HERE / "src")]) + [(b.name, b / "src") for b in args.base]
        for name, src in versions:
            os.environ["PYTHONPATH"] = str(src)  # the engine process imports this version
            extra = args.extra.split() if name == "this" else []
            e = EngineProcess(model, slots=args.streams, ctx_size=ctx, threads=args.threads, extra=extra).start(
                work, name
            )
            stop.append(e)
            servers[name] = e.url
            pids[name] = e.pid
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
        if peer_bin is not None:
            peer = LlamaServer(
                peer_bin, model, ctx=ctx, slots=args.streams, log_dir=work, tag="llama-server", threads=args.threads
            )
            stop.append(peer)
            servers["llama-server"] = peer.url
            pids["llama-server"] = peer.proc.pid
        names = list(servers)
        rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for rnd in range(args.rounds + 1):  # round 0 warms every server up, unmeasured
            prompts = prompts_for(rnd, args.streams, args.words)
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            line = []
            for name in order:
                pid = pids[name]
                ours = name != "llama-server"
                m0 = {k: metric_value(servers[name], v) for k, v in COUNTERS.items()} if ours else {}
                c0, t0 = cpu_s(pid), thread_cpu_s(pid, pid)
                row = trio.run(_streams, servers[name], prompts, args.tokens)
                row["cpu_us_per_token"] = (cpu_s(pid) - c0) / max(1, row["tokens"]) * 1e6
                if ours:  # the trio thread is the main thread
                    row["trio_cpu_us_per_token"] = (thread_cpu_s(pid, pid) - t0) / max(1, row["tokens"]) * 1e6
                    row.update({k: metric_value(servers[name], v) - m0[k] for k, v in COUNTERS.items()})
                    row["tokens_per_step"] = row["step_tokens"] / max(1, row["steps"])
                if rnd:
                    rows[name].append(row)
                line.append(f"{name} {row['tok_s']:.1f} tok/s ({row['cpu_us_per_token']:.0f} us CPU/token"
                            + (f", {row['steps']:.0f} steps of {row['tokens_per_step']:.1f})" if ours else ")"))
            print(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: " + ", ".join(line), flush=True)
    finally:
        for s in stop:
            s.stop()
    result: dict[str, Any] = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "env": env_info(),
        "load_before": os.getloadavg(),
        "rows": rows,
        "median_tok_s": {n: statistics.median(r["tok_s"] for r in rs) for n, rs in rows.items()},
        "ratios": {},
    }
    first = next(iter(rows))  # this checkout, else the first base
    pairs = [(n, "llama-server") for n in rows if n != "llama-server"] + [
        (first, n) for n in rows if n not in (first, "llama-server")
    ]
    for a, b in pairs:
        if a in rows and b in rows:
            ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(rows[a], rows[b], strict=True)]
            result["ratios"][f"{a}/{b}"] = summary(ratios)
            s = result["ratios"][f"{a}/{b}"]
            cpu = summary(
                [x["cpu_us_per_token"] / y["cpu_us_per_token"] for x, y in zip(rows[a], rows[b], strict=True)]
            )
            result["ratios"][f"{a}/{b} cpu per token"] = cpu
            print(f"{a} / {b}: tok/s median {s['median']:.2f}x "
                  f"[{s['min']:.2f}-{s['max']:.2f}] over {len(ratios)} rounds; "
                  f"CPU per token {cpu['median']:.2f}x [{cpu['min']:.2f}-{cpu['max']:.2f}]")
    for n, rs in rows.items():
        print(f"{n}: median {result['median_tok_s'][n]:.1f} tok/s, ITL p50 "
              f"{statistics.median(r['itl_p50_ms'] for r in rs):.1f} ms, "
              f"p99 {statistics.median(r['itl_p99_ms'] for r in rs):.1f} ms, CPU "
              f"{statistics.median(r['cpu_us_per_token'] for r in rs):.0f} us/token"
              + (f" (trio thread {statistics.median(r['trio_cpu_us_per_token'] for r in rs):.0f}), "
                 f"{statistics.median(r['steps'] for r in rs):.0f} steps of "
                 f"{statistics.median(r['tokens_per_step'] for r in rs):.2f} tokens"
                 if "steps" in rs[0] else ""))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
