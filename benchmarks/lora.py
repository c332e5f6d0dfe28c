"""`python -m benchmarks.lora [--preset small|bench|tiny] [--streams 4] [--tokens 96]
[--rounds 3] [--with-llama-server | --llama-server PATH] [--out PATH]`

What LoRA adapters cost, on a synthetic base and two synthetic adapters (rank 8 on every
attention and feed-forward matrix, ``hydra-trio make-model --lora``):

1. The switch, on the bare backend: llama.cpp applies adapters per context and reserves its
   compute graph again after a change (``llama_set_adapters_lora``), so one-token decodes
   of two slots under two sets, one after the other, are timed against the same decodes
   with both slots under one set (each number the median of ``--rounds`` runs of 64).
2. The engine: ``--streams`` concurrent greedy completions of ``--tokens`` tokens each
   (``ignore_eos``), aggregate tok/s, the streams' inter-token gaps (median, p90) and the
   slowest stream's time, for: no
   adapter loaded; adapters loaded but unused; every stream under one adapter; the streams
   split over two sets (base and an adapter, taking turns a batch each); every stream a set
   of its own.
3. With llama-server (the same llama.cpp): every stream under one adapter, and the split
   workload, llama-server given the adapters with ``--lora`` and each request its ``lora``
   list (it batches the first slot's set and lets the others wait).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.harness import EngineProcess, env_info
from hydra_trio.model.synthetic import write_model
from hydra_trio.model.synthetic_lora import write_lora_adapter

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "the lighthouse keeper wrote the weather in the log every night and"
A, B = [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}]
WORKLOADS: dict[str, list[list[dict[str, Any]] | None]] = {
    # Each stream's lora list (None: the request names none).
    "base, no adapter loaded": [None],
    "base, adapters loaded": [[]],
    "one adapter": [A],
    "two sets (base + adapter)": [[], A],
    "a set per stream": [[], A, B, [{"id": 0, "scale": 0.5}]],
}


def switch_cost(model: str, adapters: list[str], threads: int, rounds: int) -> dict[str, float]:
    """Median seconds of a one-token decode: both slots under one set, and alternating sets."""
    from hydra_trio.engine.llama import LlamaBackend

    backend = LlamaBackend(
        model, n_slots=2, n_ctx=2048, n_threads=threads, n_batch=512, kv_unified=False, lora_paths=adapters
    )
    try:
        prompt = backend.tokenize(PROMPT, add_special=True)
        for slot in (0, 1):
            backend.eval_chunk(slot, prompt, None)
        token = prompt[-1]

        def run(sets: tuple[Any, Any]) -> float:
            backend.seq_lora[0], backend.seq_lora[1] = sets
            for slot in (0, 1):
                backend.truncate_slot(slot, len(prompt))
            backend.eval_chunk(0, [token], None)  # the first decode under these sets: not timed
            backend.eval_chunk(1, [token], None)
            t0 = time.perf_counter()
            for _ in range(32):
                backend.eval_chunk(0, [token], None)
                backend.eval_chunk(1, [token], None)
            return (time.perf_counter() - t0) / 64

        one = ((0, 1.0),)
        out: dict[str, list[float]] = {"base": [], "one adapter": [], "alternating base / adapter": []}
        for _ in range(rounds):
            out["base"].append(run(((), ())))
            out["one adapter"].append(run((one, one)))
            out["alternating base / adapter"].append(run(((), one)))
        return {k: statistics.median(v) for k, v in out.items()}
    finally:
        backend.close()


async def _streams(url: str, sets: list[Any], streams: int, n: int) -> dict[str, float]:
    """``streams`` concurrent streamed completions, stream i under ``sets[i % len(sets)]``."""
    gaps: list[float] = []
    tokens = 0
    durations: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:

        async def go(i: int) -> None:
            nonlocal tokens
            body: dict[str, Any] = {
                "prompt": PROMPT,
                "max_tokens": n,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            if sets[i % len(sets)] is not None:
                body["lora"] = sets[i % len(sets)]
            last, t_start = None, time.perf_counter()
            async with c.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        tokens += 1
            durations.append(time.perf_counter() - t_start)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(go, i)
        wall = time.perf_counter() - t0
    gaps.sort()
    return {
        "tok_s": tokens / wall,
        "itl_ms": 1000 * statistics.median(gaps) if gaps else 0.0,
        "itl_p90_ms": 1000 * gaps[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
        "slowest_s": max(durations),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.split("\n\n")[1])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "bench"])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--with-llama-server", action="store_true")
    ap.add_argument("--llama-server", default=None, help="an existing llama-server binary")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hydra-lora-bench-"))
    model = str(write_model(tmp / f"{args.preset}.gguf", args.preset, seed=0))
    adapters = [str(write_lora_adapter(model, tmp / f"adapter-{i}.gguf", seed=i + 1)) for i in range(2)]
    result: dict[str, Any] = {"env": env_info(), "preset": args.preset, "streams": args.streams, "tokens": args.tokens,
                              "threads": args.threads}

    cost = switch_cost(model, adapters, args.threads, args.rounds)
    result["decode_s"] = cost
    print(f"one-token decode, two slots in turn (median of {args.rounds} runs of 64):")
    for name, s in cost.items():
        print(f"  {name:>28}: {s * 1000:7.3f} ms")
    print("  switching sets costs "
          f"{(cost['alternating base / adapter'] - (cost['base'] + cost['one adapter']) / 2) * 1000:.3f} ms a decode")

    # Every server up at once, the workloads interleaved round by round: a busy machine's
    # noise falls on all of them alike.
    from benchmarks.llama_server import LlamaServer, find_or_build

    plain = EngineProcess(model, slots=args.streams, ctx_size=2048 * args.streams, threads=args.threads).start(
        tmp, "plain"
    )
    loaded = EngineProcess(model, slots=args.streams, ctx_size=2048 * args.streams, threads=args.threads,
                           extra=["--lora", ",".join(adapters), "--lora-init-without-apply"]).start(tmp, "loaded")
    binary = (
        find_or_build(args.llama_server, args.with_llama_server)
        if (args.llama_server or args.with_llama_server)
        else None
    )
    peer = None
    if binary is not None:
        peer = LlamaServer(binary, model, ctx=2048 * args.streams, slots=args.streams, log_dir=tmp, tag="llama-server",
                           threads=args.threads, extra=["--lora", ",".join(adapters)])
    # (label, url, sets): llama-server reads an empty list as its defaults, so its base
    # requests list every adapter at 0.
    base_off = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    runs_of: list[tuple[str, str, list[Any]]] = [
        (name, plain.url if name == "base, no adapter loaded" else loaded.url, sets) for name, sets in WORKLOADS.items()
    ]
    if peer is not None:
        runs_of += [
            (f"llama-server, {name}", peer.url, [s if s else base_off for s in WORKLOADS[name]])
            for name in ("base, adapters loaded", "one adapter", "two sets (base + adapter)", "a set per stream")
        ]
    got: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in runs_of}
    try:
        for _label, url, sets in runs_of:
            trio.run(_streams, url, sets, args.streams, 4)  # warm: every batch shape once
        for _ in range(args.rounds):
            for label, url, sets in runs_of:
                got[label].append(trio.run(_streams, url, sets, args.streams, args.tokens))
    finally:
        plain.stop()
        loaded.stop()
        if peer is not None:
            peer.stop()
    rows: list[dict[str, Any]] = []
    keys = ("tok_s", "itl_ms", "itl_p90_ms", "slowest_s")
    for label, runs in got.items():
        row = {"workload": label, **{k: statistics.median(r[k] for r in runs) for k in keys}, "runs": runs}
        rows.append(row)
        print(f"{label:>45} x{args.streams}: {row['tok_s']:7.1f} tok/s, ITL {row['itl_ms']:6.2f} ms "
              f"(p90 {row['itl_p90_ms']:6.2f}), slowest stream {row['slowest_s']:5.2f} s")
    result["runs"] = rows
    out = Path(args.out) if args.out else RESULTS / f"lora-{args.preset}-{args.streams}-streams.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
