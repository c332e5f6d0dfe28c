"""Embeddings/s and rerank pairs/s (issue 51), hydra-trio against llama-server on the same
GGUF, at 1 and 8 clients.

    python -m benchmarks.pooled [--rounds 5] [--threads 1] [--requests 24] [--llama-server PATH]
                                [--preset small] [--skip embeddings,rerank] [--base CHECKOUT]

Models: the ``small`` preset's shape (33 M params) as an embedding model (mean pooling) and as
a reranker (qwen3 with Qwen3-Reranker's rank head and template), written once into the user
cache. Both engines run the same llama thread count; llama-server with ``--embeddings`` (or
``--reranking``), ``-np 8`` and a batch of 512, ours with its embedding context of 512 tokens
and 32 inputs a call. llama-server runs twice: as it starts by default (a KV stream per slot)
and with ``--kv-unified``: with the split cache, inputs of different lengths that its slots
batch together come out wrong (a mean pooled over part of the input: ggml-org/llama.cpp#26282,
measured in tests/system/test_llama_server_pooled.py), so the unified one is the peer whose answers
are right. Each client sends requests back to back: an embeddings request is one input of
about 64 tokens (``--inputs N``: N of them), a rerank request a query and 8 documents. The machine is shared, so every
figure is a ratio within one round: each round runs a workload on every engine, their order
rotating, and every round is printed. Two figures each: inputs per second of wall time, and
inputs per CPU second of the server process (all its threads: what the work cost it, which
other processes on a loaded machine move far less than the wall time). ``--base`` adds another
checkout of the project (``git worktree add /tmp/base COMMIT``: its ``src`` first on the
engine's PYTHONPATH) as a fourth peer, ``hydra-trio-base``: before and after in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
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
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """A process's CPU seconds, every thread, user + system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


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


def bodies(kind: str, n: int, seed: int, inputs: int = 1) -> list[dict[str, Any]]:
    """``n`` request bodies, each its own text (no engine caches a pooled input anyway);
    ``inputs`` texts in an embeddings request."""
    out = []
    for i in range(n):
        if kind == "embeddings":
            texts = [words_prompt(48, seed=seed * 100000 + i * 100 + j) for j in range(inputs)]
            out.append({"input": texts[0] if inputs == 1 else texts})
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
    ours = EngineProcess(
        model,
        slots=2,
        ctx_size=2048,
        threads=args.threads,
        batch_size=512,
        # llama-server queues without a bound: so does ours here (its default
        # answers 503 to a request whose turn has not come in 30 s).
        extra=[*ours_flags, "--embd-batch-inputs", "32", "--slot-wait-s", "600"],
    ).start(log_dir, f"hydra-{kind}")
    peers = {"hydra-trio": (ours.url, ours.pid)}
    servers: list[Any] = []
    try:
        if args.base is not None:
            before = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = str(args.base / "src")  # the engine process imports that version
            try:
                base = EngineProcess(
                    model,
                    slots=2,
                    ctx_size=2048,
                    threads=args.threads,
                    batch_size=512,
                    extra=[*ours_flags, "--embd-batch-inputs", "32", "--slot-wait-s", "600"],
                ).start(log_dir, f"base-{kind}")
            finally:
                if before is None:
                    del os.environ["PYTHONPATH"]
                else:
                    os.environ["PYTHONPATH"] = before
            servers.append(base)
            peers["hydra-trio-base"] = (base.url, base.pid)
        for name, more in (("llama-server", []), ("llama-server-kvu", ["--kv-unified"])):
            server = LlamaServer(binary, model, ctx=8 * 512, slots=8, log_dir=log_dir, tag=f"{name}-{kind}",
                                 threads=args.threads, extra=[*theirs_flags, "-b", "512", "-ub", "512", *more])
            servers.append(server)
            peers[name] = (server.url, server.proc.pid)
        return _rounds(kind, peers, args)
    finally:
        ours.stop()
        for server in servers:
            server.stop()


def _rate(peer: tuple[str, int], kind: str, clients: int, work: list[dict[str, Any]]) -> tuple[float, float]:
    """(inputs per wall second, inputs per server CPU second)."""
    url, pid = peer
    c0 = cpu_s(pid)
    wall, n = trio.run(drive, url, kind, clients, work)
    return n / wall, n / max(cpu_s(pid) - c0, 1e-9)


def _rounds(kind: str, peers: dict[str, tuple[str, int]], args: argparse.Namespace) -> dict[str, Any]:
    unit = "inputs/s" if kind == "embeddings" else "pairs/s"
    out: dict[str, Any] = {}
    for clients in (1, 8):
        rounds = []
        for rnd in range(args.rounds):
            n = args.requests if kind == "embeddings" else max(1, args.requests // 3)
            work = bodies(kind, n, seed=rnd + 100 * clients, inputs=args.inputs)
            order = list(peers.items())
            order = order[rnd % len(order):] + order[: rnd % len(order)]  # each engine leads in turn
            measured = {name: _rate(peer, kind, clients, work) for name, peer in order}
            rates = {name: m[0] for name, m in measured.items()}
            per_cpu = {f"{name} per cpu s": m[1] for name, m in measured.items()}
            ratios = {f"vs {name}": rates["hydra-trio"] / rates[name] for name in peers if name != "hydra-trio"}
            ratios |= {
                f"cpu vs {name}": measured["hydra-trio"][1] / measured[name][1]
                for name in peers
                if name != "hydra-trio"
            }
            rounds.append({**rates, **per_cpu, **ratios})
            print(f"{kind} {clients} "
                  f"client(s) round {rnd}: " + ", ".join(f"{n} {r:.1f} {unit}" for n, r in rates.items())
                  + "; ratios " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), flush=True)
        summary: dict[str, Any] = {"rounds": rounds}
        for name in peers:
            summary[f"{name} median"] = statistics.median(r[name] for r in rounds)
            for key in (f"vs {name}", f"cpu vs {name}"):
                if name != "hydra-trio":
                    values = [r[key] for r in rounds]
                    summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        out[str(clients)] = summary
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=24, help="requests per workload (per round and engine)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--inputs", type=int, default=1, help="texts per embeddings request (RAG indexing sends many)")
    p.add_argument("--preset", default="small")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--skip", default="")
    p.add_argument("--name", default="pooled")
    p.add_argument("--base", type=Path, default=None, help="another checkout, run as a fourth peer (its src/ is used)")
    args = p.parse_args()
    if args.base is not None and not (args.base / "src" / "hydra_trio").is_dir():
        p.error(f"--base {args.base}: no src/hydra_trio there")
    binary = find_or_build(args.llama_server, build=False)
    if binary is None:
        raise SystemExit("llama-server is needed for this comparison (--llama-server PATH)")
    paths = models(args.preset)
    results: dict[str, Any] = {
        "env": env_info(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    with tempfile.TemporaryDirectory(prefix="bench-pooled-") as tmp:
        for kind in ("embeddings", "rerank"):
            if kind not in args.skip.split(","):
                results[kind] = run_kind(kind, paths[kind], binary, args, Path(tmp))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(results, indent=1) + "\n")
    for kind in ("embeddings", "rerank"):
        for clients, r in results.get(kind, {}).items():
            line = ", ".join(f"{k} {v['median']:.3f} "
                             f"[{v['min']:.3f}-{v['max']:.3f}]" for k, v in r.items() if isinstance(v, dict))
            rates = ", ".join(f"{k.removesuffix(' median')} {v:.1f}/s" for k, v in r.items() if k.endswith(" median"))
            print(f"{kind:10s} {clients} client(s): hydra-trio {line} ({rates})")


if __name__ == "__main__":
    main()
