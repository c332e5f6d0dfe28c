"""`python -m benchmarks.threads [--preset bench] [--tokens 128] [--repeats 3]`

The default ``--threads`` (the cores but one): generation speed of one stream with each
thread count from 1 to the core count, on a quiet machine and with one core kept busy by
another process (a shared machine). ggml's threads wait for each other at every barrier
by spinning, so a llama thread that has to share its core with anything (the engine's own
trio thread, another job) stalls all of them. Writes benchmarks/results/threads-<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from .__main__ import RESULTS, build_models
from .harness import EngineProcess, env_info, summary, words_prompt


@contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """Another process spinning on one core while the block runs (or nothing)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def tok_per_s(url: str, n: int, seed: int) -> float:
    body = {"prompt": words_prompt(32, seed=seed), "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return float(r.json()["timings"]["predicted_per_second"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "hydra-trio" / "bench"))
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    model = build_models(cache, [args.preset])[args.preset]
    log_dir = RESULTS / "threads-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 2
    rows: dict[str, Any] = {}
    for threads in range(1, cores + 1):
        e = EngineProcess(model, slots=1, ctx_size=2048, threads=threads).start(log_dir, f"threads-{threads}")
        try:
            tok_per_s(e.url, 8, seed=99)  # warm
            for busy in (False, True):
                with busy_core(busy):
                    rates = [tok_per_s(e.url, args.tokens, seed=i) for i in range(args.repeats)]
                rows[f"{threads}-{'busy' if busy else 'quiet'}"] = {
                    "threads": threads,
                    "busy_core": busy,
                    "tok_s": summary(rates),
                }
                print(f"threads {threads}, {'one core busy' if busy else 'quiet'}: "
                      f"{summary(rates)['median']:.1f} tok/s", flush=True)
        finally:
            e.stop()
    out = RESULTS / f"threads-{args.preset}.json"
    out.write_text(json.dumps({"preset": args.preset, "cores": cores, "rows": rows, "env": env_info()}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
