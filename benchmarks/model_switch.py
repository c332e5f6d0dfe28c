"""`python -m benchmarks.model_switch [--preset small] [--switches 100] [--wakes 10] [--parts switch,wake,stall,lanes]`

What a model switch costs when one process serves several models (serving/model_pool.py), on three
synthetic models of ``--preset`` (same shape, other weights) with ``--models-max 2``: ``a``,
the RPC model, stays; ``b`` and ``c`` evict each other, so every request that alternates
between them is a cold switch (free the other, load, warm up, answer).

1. **Cold switch**: ``--switches`` requests alternating b and c (one token each): the client's
   latency (p50/p99) against a request to the resident model, and the server's load time
   (``/models`` ``last_load_ms``) of each.
2. **Nothing leaked**: the server's RSS, open descriptors, /dev/shm files and trio tasks
   before the switches (after a warm-up switch of each) and after them.
3. **Wake**: a second process with ``--sleep-idle-seconds``: b is left idle until it sleeps,
   then asked again, ``--wakes`` times: the wake's latency and ``last_wake_ms`` against a
   cold load.
4. **Stall**: how long a stream of ``a`` stops while ``b`` loads: every model's
   llama.cpp calls share the GPU worker's lane, so a load holds the others' steps.
5. **Lanes** (``--parts lanes``, in-process): two models generating at once, their engines on one
   shared lane or a lane each, with 1 and with 2 llama threads per engine.

Writes benchmarks/results/model-switch-<preset>-<parts>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import trio

from hydra_trio.testing.metrics_reader import sample_value
from hydra_trio.testing.process import EngineProcess
from hydra_trio.testing.workload import percentile

from .__main__ import RESULTS
from .harness import env_info

PROMPT = "the slot cache engine serves many models"


def write_models(folder: Path, preset: str) -> dict[str, str]:
    from hydra_trio.model.synthetic import write_model

    out = {}
    for i, name in enumerate("abc"):
        path = folder / f"{preset}-{name}.gguf"
        if not path.exists():
            write_model(path, preset, seed=100 + i, name=f"Switch {name.upper()}")
        out[name] = str(path)
    return out


def serve(models: dict[str, str], log_dir: Path, tag: str, *extra: str) -> EngineProcess:
    named = [f"{n}={p}" for n, p in models.items()]
    more = [arg for entry in named[1:] for arg in ("--model", entry)]
    return EngineProcess(named[0], slots=2, ctx_size=2048, threads=max(1, (os.cpu_count() or 2) - 1),
                         extra=[*more, "--models-max", "2", *extra]).start(log_dir, tag)


def ask(client: httpx.Client, model: str, max_tokens: int = 1) -> float:
    t0 = time.perf_counter()
    r = client.post(
        "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def listing(client: httpx.Client) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in client.get("/models").json()["data"]}


def process_figures(proc: EngineProcess, client: httpx.Client) -> dict[str, Any]:
    """The server's RSS, open descriptors, its /dev/shm files (handoff/shm.py names them by
    uid and pid: its probe, and any KV export) and the tasks of its trio run."""
    fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
    own = f"hydra-kv-{os.getuid()}-{proc.pid}-"
    shm = sorted(n for n in os.listdir("/dev/shm") if n.startswith(own)) if os.path.isdir("/dev/shm") else []
    tasks = sample_value(client.get("/metrics").text, "hydra_trio_tasks")
    return {"rss_mib": round(proc.rss_bytes() / 2**20, 1), "fds": fds, "shm_files": len(shm), "trio_tasks": tasks}


def ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(values, 50) * 1000, 1), "p99_ms": round(percentile(values, 99) * 1000, 1),
            "max_ms": round(max(values) * 1000, 1), "n": len(values)}


def switches(models: dict[str, str], log_dir: Path, n: int) -> dict[str, Any]:
    proc = serve(models, log_dir, "switch")
    try:
        with httpx.Client(base_url=proc.url, timeout=300) as client:
            for name in "abc":  # every model loaded once, and the first switch's one-off costs paid
                ask(client, name)
            ask(client, "b")
            time.sleep(1.0)
            before = process_figures(proc, client)
            cold, loads, along = [], [], []
            for i in range(n):
                name = "c" if i % 2 == 0 else "b"
                cold.append(ask(client, name))
                loads.append(listing(client)[name]["last_load_ms"] / 1000.0)
                if (i + 1) % 25 == 0:  # does anything grow with the number of switches?
                    along.append({"switches": i + 1, **process_figures(proc, client)})
            warm = [ask(client, "a") for _ in range(20)]
            time.sleep(1.0)
            after = process_figures(proc, client)
            models_now = listing(client)
    finally:
        proc.stop()
    return {
        "cold_switch": ms(cold),
        "load_server": ms(loads),
        "resident_request": ms(warm),
        "before": before,
        "after": after,
        "along": along,
        "loads": {k: v["loads"] for k, v in models_now.items()},
        "evictions": {k: v["evictions"] for k, v in models_now.items()},
    }


def wakes(models: dict[str, str], log_dir: Path, n: int) -> dict[str, Any]:
    proc = serve(models, log_dir, "wake", "--sleep-idle-seconds", "0.5")
    try:
        with httpx.Client(base_url=proc.url, timeout=300) as client:
            ask(client, "b")  # the cold load (with its warm-up)
            load = listing(client)["b"]["last_load_ms"] / 1000.0
            woke, server = [], []
            for _ in range(n):
                deadline = time.monotonic() + 60
                while listing(client)["b"]["status"]["value"] != "sleeping":
                    assert time.monotonic() < deadline, "b never fell asleep"
                    time.sleep(0.05)
                woke.append(ask(client, "b"))
                server.append(listing(client)["b"]["last_wake_ms"] / 1000.0)
            final = listing(client)["b"]
    finally:
        proc.stop()
    return {"wake_request": ms(woke), "wake_server": ms(server), "cold_load_server_ms": round(load * 1000, 1),
            "wakes": final["wakes"], "sleeps": final["sleeps"]}


def stall(models: dict[str, str], log_dir: Path, rounds: int = 6) -> dict[str, Any]:
    """The longest gap between two tokens of a stream of ``a`` while another model loads (b
    and c in turn, each evicting the other), against the stream's longest gap with nothing
    loading; the stream is read as its tokens arrive, the load asked from a second client."""
    proc = serve(models, log_dir, "stall")

    async def longest_gap(url: str, load: str | None) -> tuple[float, float | None]:
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True}
        stamps: list[float] = []
        load_s: float | None = None
        async with httpx.AsyncClient(base_url=url, timeout=300) as client, trio.open_nursery() as nursery:

            async def ask_load() -> None:
                nonlocal load_s
                t0 = time.perf_counter()
                (await client.post("/models/load", json={"model": load})).raise_for_status()
                load_s = time.perf_counter() - t0

            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.perf_counter())
                        if len(stamps) == 20 and load is not None:
                            nursery.start_soon(ask_load)
        return max(b - a for a, b in pairwise(stamps)), load_s

    try:
        quiet, loading, load_req = [], [], []
        for i in range(rounds):
            quiet.append(trio.run(longest_gap, proc.url, None)[0])
            gap, took = trio.run(longest_gap, proc.url, "b" if i % 2 == 0 else "c")
            loading.append(gap)
            assert took is not None
            load_req.append(took)
    finally:
        proc.stop()
    return {"longest_gap_quiet": ms(quiet), "longest_gap_while_loading": ms(loading), "load_request": ms(load_req)}


async def _lane_run(models: dict[str, str], shared: bool, threads: int, n_tokens: int) -> dict[str, Any]:
    from hydra_trio.config import Settings
    from hydra_trio.engine import Engine, WorkerLane

    settings = Settings(slots=2, ctx_size=1024, threads=threads, batch_size=64, warmup=True, log_level="WARNING")
    lane = WorkerLane() if shared else None
    engines = [await Engine.load(models[n], settings, alias=n, lane=lane) for n in "ab"]
    from hydra_trio.engine import GenerationParams, SamplingParams

    params = GenerationParams(n_tokens, SamplingParams(temperature=0.0, ignore_eos=True))
    tokens_done = 0
    gaps: list[float] = []  # between two tokens of one stream

    async def stream(engine: Engine, i: int) -> None:
        nonlocal tokens_done
        prompt = await engine.tokenize(f"{PROMPT} {i}", add_special=True)
        stamps: list[float] = []

        async def emit(_text: str) -> None:
            stamps.append(time.perf_counter())

        async with engine.claim(f"bench-{i}", prompt=prompt) as lease:
            res = await lease.generate(prompt, params, emit)
        tokens_done += res.completion_tokens
        gaps.extend(b - a for a, b in pairwise(stamps))

    async with trio.open_nursery() as nursery:
        for engine in engines:
            await nursery.start(engine.run)
        t0 = time.perf_counter()
        async with trio.open_nursery() as streams:
            for k, engine in enumerate(engines):
                for j in range(2):
                    streams.start_soon(stream, engine, k * 2 + j)
        wall = time.perf_counter() - t0
        for engine in engines:
            engine.stop()
    return {"lane": "shared" if shared else "one per engine", "threads_per_engine": threads,
            "tokens": tokens_done, "wall_s": round(wall, 3), "tok_per_s": round(tokens_done / wall, 1),
            "token_gap": ms(gaps)}


def lanes(models: dict[str, str], n_tokens: int, repeats: int) -> list[dict[str, Any]]:
    out = []
    for threads in (1, 2):
        for shared in (True, False) * repeats:  # interleaved
            out.append(trio.run(_lane_run, models, shared, threads, n_tokens))
            print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--switches", type=int, default=100)
    ap.add_argument("--wakes", type=int, default=10)
    ap.add_argument("--parts", default="switch,wake,stall", help="a comma list of switch, wake, stall, lanes")
    ap.add_argument("--lane-tokens", type=int, default=128)
    ap.add_argument("--lane-repeats", type=int, default=3)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    cache = Path.home() / ".cache" / "hydra-trio" / "bench-models"
    cache.mkdir(parents=True, exist_ok=True)
    models = write_models(cache, args.preset)
    report: dict[str, Any] = {"env": env_info(), "preset": args.preset, "model_bytes": os.path.getsize(models["a"])}
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        for part, run in (
            ("switch", lambda: switches(models, log_dir, args.switches)),
            ("wake", lambda: wakes(models, log_dir, args.wakes)),
            ("stall", lambda: stall(models, log_dir)),
            ("lanes", lambda: lanes(models, args.lane_tokens, args.lane_repeats)),
        ):
            if part in parts:
                report[part] = run()
                print(json.dumps(report[part], indent=2), flush=True)
    report["load_average_after"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"model-switch-{args.preset}-{'-'.join(sorted(parts))}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
