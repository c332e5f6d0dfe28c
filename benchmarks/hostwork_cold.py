"""The worker's CPU outside ``llama_decode`` per token with no probes, and the same steps with
caches left warm: how much of a token's host work is Python running after a decode has
evicted the caches (issue 53).

    python -m benchmarks.hostwork_cold [--model gemma|tiny|PATH] [--streams 1,8,64]
        [--tokens 32] [--rounds 3] [--out benchmarks/results/...json]

One process, the model's LlamaBackend (as ``hostwork --steps-ab``: 256 cells a stream, one
llama thread), greedy with ``ignore_eos``, the steps run one after another. ``llama_decode``
alone is timed (its thread CPU time), not each part: a probe's own code runs cold after a
decode too, and adds to what it measures. Per round and stream count two runs: ``real``,
every step decoded; ``warm``, the same steps where ``llama_decode`` returns at once after
the first (the logits stay those of that decode, the caches hold what the last step touched):
the difference is what the cold caches cost. Compare checkouts by running it with each one's
``src`` first on ``PYTHONPATH``, on the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp

from .harness import env_info, words_prompt


class DecodeClock:
    """``llama_cpp.llama_decode`` wrapped: its thread CPU time summed; ``skip`` returns 0 at once."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.skip = False
        self._decode = llama_cpp.llama_decode
        llama_cpp.llama_decode = self._timed

    def _timed(self, ctx: Any, batch: Any) -> int:
        t0 = time.thread_time()
        try:
            return 0 if self.skip else self._decode(ctx, batch)
        finally:
            self.cpu += time.thread_time() - t0


def model_path(name: str) -> str:
    if name == "tiny":
        from .__main__ import build_models

        cache = Path.home() / ".cache" / "hydra-trio" / "bench"
        cache.mkdir(parents=True, exist_ok=True)
        return str(build_models(cache, ["tiny"])["tiny"])
    if name == "gemma":
        from hydra_trio.model.registry import named_model_path

        return str(named_model_path("gemma3-270m"))
    return name


def run(model: str, counts: list[int], n_steps: int, rounds: int) -> list[dict[str, Any]]:
    from hydra_trio.engine.llama.context import LlamaBackend
    from hydra_trio.engine.llama.types import StepRequest
    from hydra_trio.engine.sample import Sampler, SamplingParams

    clock = DecodeClock()
    n_slots = max(counts)
    backend = LlamaBackend(model, n_slots=n_slots, n_ctx=n_slots * 256, n_threads=1, n_batch=max(512, n_slots))
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(rounds + 1):  # round 0 warms up, unmeasured
            for n in counts:
                for mode in ("real", "warm") if rnd % 2 else ("warm", "real"):
                    samplers = [Sampler(SamplingParams(ignore_eos=True)) for _ in range(n)]
                    tokens = []
                    for slot in range(n):
                        text = f"{chr(97 + slot % 26)}{rnd} " + words_prompt(12, seed=1000 * rnd + slot)
                        prompt = backend.tokenize(text, add_special=True)
                        backend.clear_slot(slot)
                        tokens.append(backend.eval_chunk(slot, prompt, None, sampler=samplers[slot])[0])
                    res = backend.step([StepRequest(s, tokens[s], samplers[s], n_steps + 2) for s in range(n)])
                    tokens = [r[-1] for r in res]  # type: ignore[index]
                    clock.skip = mode == "warm"
                    d0, c0 = clock.cpu, time.thread_time()
                    for _ in range(n_steps):
                        res = backend.step([StepRequest(s, tokens[s], samplers[s], n_steps + 2) for s in range(n)])
                        tokens = [r[-1] for r in res]  # type: ignore[index]
                    outside = time.thread_time() - c0 - (clock.cpu - d0)
                    clock.skip = False
                    for sampler in samplers:
                        sampler.close()
                    if not rnd:
                        continue
                    row = {"round": rnd, "streams": n, "mode": mode,
                           "worker_cpu_outside_decode_us_per_token": outside / (n * n_steps) * 1e6,
                           "load": os.getloadavg()[0]}
                    rows.append(row)
                    print(f"round {rnd} {n:3d} streams {mode}: {row['worker_cpu_outside_decode_us_per_token']:7.1f} "
                          f"us/token outside llama_decode (load {row['load']:.1f})", flush=True)
    finally:
        backend.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hostwork_cold", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma", help="gemma, tiny or a GGUF path")
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    counts = [int(x) for x in args.streams.split(",")]
    rows = run(model_path(args.model), counts, args.tokens, args.rounds)
    for n in counts:
        got = {m: [r["worker_cpu_outside_decode_us_per_token"] for r in rows if r["streams"] == n and r["mode"] == m]
               for m in ("real", "warm")}
        print(f"{n} streams: " + ", ".join(
            f"{m} {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]" for m, v in got.items()) + " us/token")
    if args.out:
        import hydra_trio

        args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "env": env_info(),
                                        "src": hydra_trio.__file__, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
