"""Embeddings/s and rerank pairs/s (issue 51), hydra-trio against llama-server on the same
GGUF, at 1 and 8 clients.

    python -m benchmarks.pooled [--rounds 5] [--threads 1] [--requests 24] [--llama-server PATH]
                                [--preset small] [--skip embeddings,rerank]

Models: the ``small`` preset's shape (33 M params) as an embedding model (mean pooling) and as
a reranker (qwen3 with Qwen3-Reranker's rank head and template), written once into the user
cache. Both engines run the same llama thread count; llama-server with ``--embeddings`` (or
``--reranking``), ``-np 8`` and a batch of 512, ours with its embedding context of 512 tokens
and 32 inputs a call. Each client sends requests back to back: an embeddings request is one
input of about 64 tokens, a rerank request a query and 8 documents. The machine is shared, so
every figure is a ratio within one round: each round runs a workload on both engines, their
order alternating, and every round is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import trio

from hydra_trio.model import synthetic

from .harness import EngineProcess, env_info, words_prompt
from .llama_server import LlamaServer, find_or_build

RESULTS = Path(__file__).resolve().parent / "results"


def models(preset: str) -> dict[str, str]:
    cache = synthetic.cache_dir()
    embed = cache / f"hydra-bench-embed-{preset}-v{synthetic.SYNTHETIC_FORMAT_VERSION}.gguf"
    rerank = cache / f"hydra-bench-rerank-{preset}-v{synthetic.SYNTHETIC_FORMAT_VERSION}.gguf"
    if not embed.exists():
        synthetic.write_model(embed, preset, pooling="mean", name="Hydra Bench Embed")
    if not rerank.exists():
        synthetic.PRESETS["_rerank"] = replace(synthetic.PRESETS[preset], arch="qwen3", pooling="rank")
        try:
            synthetic.write_model(rerank, "_rerank", name="Hydra Bench Rerank")
        finally:
            del synthetic.PRESETS["_rerank"]
    return {"embeddings": str(embed), "rerank": str(rerank)}


def bodies(kind: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` request bodies, each its own text (no engine caches a pooled input anyway)."""
    out = []
    for i in range(n):
        if kind == "embeddings":
            out.append({"input": words_prompt(48, seed=seed * 1000 + i)})
        else:
            docs = [words_prompt(36, seed=seed * 1000 + i * 10 + j) for j in range(8)]
            out.append({"query": words_prompt(10, seed=seed * 1000 + i), "documents": docs})
    return out


async def drive(url: str, kind: str, clients: int, work: list[dict[str, Any]]) -> tuple[float, int]:
    """(wall seconds, inputs done) of ``work`` sent by ``clients`` clients back to back."""
    path = "/v1/embeddings" if kind == "embeddings" else "/v1/rerank"
    queue = list(reversed(work))
    done = 0

    async def client(h: httpx.AsyncClient) -> None:
        nonlocal done
        while queue:
            body = queue.pop()
            r = await h.post(path, json=body)
            r.raise_for_status()
            out = r.json()
            done += len(out["data"]) if kind == "embeddings" else len(out["results"])

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as h:
        await h.post(path, json=work[0])  # warm: first-call allocations out of the timing
        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for _ in range(clients):
                n.start_soon(client, h)
        return time.perf_counter() - t0, done


def run_kind(kind: str, model: str, binary: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    ours_flags = ["--reranking"] if kind == "rerank" else ["--embeddings"]
    theirs_flags = ["--reranking"] if kind == "rerank" else ["--embeddings", "--pooling", "mean"]
    ours = EngineProcess(model, slots=2, ctx_size=2048, threads=args.threads, batch_size=512,
                         extra=[*ours_flags, "--embd-batch-inputs", "32"]).start(log_dir, f"hydra-{kind}")
    theirs = LlamaServer(binary, model, ctx=8 * 512, slots=8, log_dir=log_dir, tag=f"llama-server-{kind}",
                         threads=args.threads, extra=[*theirs_flags, "-b", "512", "-ub", "512"])
    out: dict[str, Any] = {}
    try:
        for clients in (1, 8):
            rounds = []
            for rnd in range(args.rounds):
                work = bodies(kind, args.requests, seed=rnd + 100 * clients)
                order = [("hydra-trio", ours.url), ("llama-server", theirs.url)]
                if rnd % 2:
                    order.reverse()
                rates = {}
                for name, url in order:
                    wall, n = trio.run(drive, url, kind, clients, work)
                    rates[name] = n / wall
                ratio = rates["hydra-trio"] / rates["llama-server"]
                rounds.append({**rates, "ratio": ratio})
                unit = "inputs/s" if kind == "embeddings" else "pairs/s"
                print(f"{kind} {clients} client(s) round {rnd}: hydra-trio {rates['hydra-trio']:.1f} {unit}, "
                      f"llama-server {rates['llama-server']:.1f} {unit}, ratio {ratio:.3f}", flush=True)
            ratios = [r["ratio"] for r in rounds]
            out[f"{clients}"] = {
                "rounds": rounds,
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "hydra_median": statistics.median(r["hydra-trio"] for r in rounds),
                "llama_server_median": statistics.median(r["llama-server"] for r in rounds),
            }
    finally:
        ours.stop()
        theirs.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=24, help="requests per workload (per round and engine)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--preset", default="small")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--skip", default="")
    p.add_argument("--name", default="pooled")
    args = p.parse_args()
    binary = find_or_build(args.llama_server, build=False)
    if binary is None:
        raise SystemExit("llama-server is needed for this comparison (--llama-server PATH)")
    paths = models(args.preset)
    results: dict[str, Any] = {"env": env_info(), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="bench-pooled-") as tmp:
        for kind in ("embeddings", "rerank"):
            if kind not in args.skip.split(","):
                results[kind] = run_kind(kind, paths[kind], binary, args, Path(tmp))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(results, indent=1) + "\n")
    for kind in ("embeddings", "rerank"):
        for clients, r in results.get(kind, {}).items():
            print(f"{kind:10s} {clients} client(s): ratio median {r['ratio_median']:.3f} [{r['ratio_min']:.3f}-{r['ratio_max']:.3f}]"
                  f" (hydra-trio {r['hydra_median']:.1f}/s, llama-server {r['llama_server_median']:.1f}/s)")


if __name__ == "__main__":
    main()
