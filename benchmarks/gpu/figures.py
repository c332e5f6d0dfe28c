"""GPU figures: the engine fully offloaded, on the bench preset (and Gemma 3 270M if installed).

    python benchmarks/gpu/figures.py OUTDIR [--budget-s S] [--llama-server PATH]
    python benchmarks/gpu/figures.py OUTDIR --preset tiny --quick     # the code path, on CPU

Per model, with every layer on the GPU (``--n-gpu-layers -1``; the JSON records what
/version says was applied):

- ``streams``: aggregate tok/s and inter-token latency at 1/8/64 concurrent streams, and the
  server's CPU per streamed token (all threads, and the trio thread alone: the front end), from
  benchmarks/ceiling.py's raw-socket client (``/v1/completions``, greedy, ``ignore_eos``);
  llama-server beside it when ``--llama-server`` is given (``-ngl 999``);
- ``handoff``: TTFT of a 4k-token hand-off (PREFILL on engine A, DECODE on engine B, both on
  the one GPU) against recomputing the prompt on B (benchmarks/figures.py's figure 1);
- ``restore``: the DECODE ack for a 128 MiB (134 MB) KV blob, against llama.cpp's own
  set_data in this process (figure 2).

Writes OUTDIR/figures.json after every step (a run cut short keeps what it measured) and the
engines' logs under OUTDIR/logs/. ``--budget-s`` skips the steps that would start past it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from benchmarks import figures as F
from benchmarks.ceiling import measure, run_round
from benchmarks.harness import EngineProcess, env_info, words_prompt
from benchmarks.llama_server import LlamaServer

GPU_FLAGS = ["--n-gpu-layers", "-1"]


class Run:
    """The JSON being written, step by step, and the time budget."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.path = out / "figures.json"
        self.deadline = time.monotonic() + budget_s
        self.data: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "env": env_info(),
            "gpu": gpu_info(),
            "models": {},
        }
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, model: str, name: str, need_s: float, fn: Callable[[], Any]) -> Any:
        """Run one figure; its result (or why it is missing) goes into the JSON at once."""
        row = self.data["models"].setdefault(model, {})
        if self.left_s() < need_s:
            row[name] = {"skipped": f"out of time ({self.left_s():.0f} s left, needs ~{need_s:.0f} s)"}
            print(f"[{model}] {name}: skipped, out of time", flush=True)
            self.save()
            return None
        print(f"[{model}] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            value = fn()
            row[name] = value
        except Exception as exc:
            value = None
            row[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
            print(f"[{model}] {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
        row.setdefault("step_s", {})[name] = round(time.perf_counter() - t0, 2)
        self.save()
        return value


def gpu_info() -> dict[str, Any]:
    """What llama.cpp sees: offload support and the ggml devices (GPU name and memory)."""
    import llama_cpp

    from hydra_trio.engine.llama.devices import read_ggml_devices

    return {
        "gpu_offload_supported": bool(llama_cpp.llama_supports_gpu_offload()),
        "devices": [d.as_dict() for d in read_ggml_devices()],
    }


def offload_of(engine: EngineProcess) -> dict[str, Any]:
    v = httpx.get(engine.url + "/version", timeout=30).json()
    keys = ("n_gpu_layers_requested", "n_gpu_layers", "n_layers", "kv_offload", "flash_attn", "main_gpu")
    out = {k: v.get(k) for k in keys}
    out["fully_offloaded"] = v.get("n_gpu_layers") == v.get("n_layers")
    return out


def fig_streams(
    model: str, counts: list[int], tokens: int, rounds: int, threads: int, log_dir: Path,
    llama_server: Path | None,
) -> dict[str, Any]:
    """Tok/s, ITL and server CPU per streamed token at each stream count (ceiling.py's client)."""
    slots = max(counts)
    slot_ctx = 64 + tokens + 64  # prompt (~20 tokens with the template) + generated, with room
    ctx = slots * slot_ctx
    ours = EngineProcess(
        model, slots=slots, ctx_size=ctx, threads=threads, batch_size=max(512, slots),
        extra=[*GPU_FLAGS, "--step-token-budget", str(max(32, slots))],
    ).start(log_dir, "streams-hydra-trio")
    peer = None
    result: dict[str, Any] = {"tokens_per_stream": tokens, "rounds": rounds}
    try:
        result["offload"] = offload_of(ours)
        if llama_server is not None:
            peer = LlamaServer(llama_server, model, ctx=ctx, slots=slots, log_dir=log_dir, tag="streams-llama-server",
                               threads=threads, extra=["-ngl", "999"])
        rows = []
        for rnd in range(rounds):
            for n in counts:
                prompts = [f"{chr(97 + (i + rnd * 7) % 26)}"
                           f"{chr(97 + (i // 26) % 26)} " + words_prompt(12, seed=1000 * rnd + i) for i in range(n)]
                servers: list[tuple[str, int, int, int | None]] = [("hydra-trio", ours.http_port, ours.pid, ours.pid)]
                if peer is not None:
                    servers.append(("llama-server", peer.port, peer.proc.pid, None))
                for name, port, pid, tid in servers if rnd % 2 == 0 else servers[::-1]:
                    row = measure(name, port, pid, tid, partial(run_round, port, prompts, tokens))
                    row["round"] = rnd
                    rows.append(row)
                    print(
                        f"  {name:12s} {n:3d} streams: {row['tok_s']:8.0f} "
                        f"tok/s, ITL p50 {row['itl_p50_ms']:.2f} ms, "
                        f"server {row['server_cpu_us_per_token']:.0f} us/token"
                        + (
                            f" (trio thread {row['trio_thread_cpu_us_per_token']:.0f})"
                            if "trio_thread_cpu_us_per_token" in row
                            else ""
                        ),
                        flush=True,
                    )
        result["rows"] = rows
    finally:
        ours.stop()
        if peer is not None:
            peer.stop()
    return result


def two_engines(model: str, ctx: int, threads: int, log_dir: Path, tag: str) -> tuple[EngineProcess, EngineProcess]:
    a = EngineProcess(model, slots=2, ctx_size=ctx, threads=threads, extra=GPU_FLAGS).start(log_dir, f"{tag}-a")
    try:
        b = EngineProcess(model, slots=2, ctx_size=ctx, threads=threads, extra=GPU_FLAGS).start(log_dir, f"{tag}-b")
    except BaseException:
        a.stop()
        raise
    return a, b


def fig_pair(
    run: Run, label: str, model: str, ctx: int, threads: int, log_dir: Path, handoff_tokens: int,
    restore_mb: int, repeats: int,
) -> None:
    """Figures 1 (hand-off TTFT) and 2 (DECODE ack) on two engines sharing the GPU."""
    tok = F.Tokenizer(model)
    a, b = two_engines(model, ctx, threads, log_dir, f"{label}-pair")
    try:
        run.data["models"][label]["pair_offload"] = {"a": offload_of(a), "b": offload_of(b)}
        run.step(label, "handoff", 20, lambda: F.fig_handoff(a, b, tok, [handoff_tokens], repeats))
        run.step(label, "restore", 30, lambda: F.fig_restore(a, b, tok, [restore_mb], repeats, model))
    finally:
        a.stop()
        b.stop()


def headline(data: dict[str, Any]) -> list[str]:
    """One line per figure, for the log."""
    lines = []
    for label, m in data["models"].items():
        for r in (m.get("streams") or {}).get("rows", []):
            lines.append(f"{label}: {r['server']} {r['streams']} streams round {r['round']}: {r['tok_s']:.0f} tok/s, "
                         f"server CPU {r['server_cpu_us_per_token']:.0f} us/token"
                         + (", trio thread "
                            f"{r['trio_thread_cpu_us_per_token']:.0f}" if "trio_thread_cpu_us_per_token" in r else ""))
        for n, r in (m.get("handoff") or {}).items():
            if isinstance(r, dict) and "handoff_ttft_ms" in r:
                lines.append(f"{label}: {n}-token hand-off TTFT {r['handoff_ttft_ms']['median']:.1f} ms "
                             f"(recompute {r['recompute_ttft_ms']['median']:.1f} ms, {r['kv_bytes'] / 1e6:.0f} MB KV)")
        for _mb, r in (m.get("restore") or {}).items():
            if isinstance(r, dict) and "decode_ack_ms" in r:
                lines.append(f"{label}: DECODE ack {r['blob_bytes'] / 1e6:.0f} "
                             f"MB: {r['decode_ack_ms']['median']:.1f} ms "
                             f"(set_data {r['inprocess_set_data_ms']['median']:.1f} ms)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--preset", default="bench", help="synthetic preset (default: bench; tiny for --quick on CPU)")
    ap.add_argument("--quick", action="store_true", help="a tiny configuration: proves "
                    "the code path on CPU in a minute")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip steps that would start past this (default: "
                    "%(default)s)")
    ap.add_argument("--streams", default=None, help="stream counts (default: 1,8,64; --quick: 1,8)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per stream (default: 128; --quick: 16)")
    ap.add_argument("--threads", type=int, default=2, help="llama threads per engine (default: %(default)s)")
    ap.add_argument("--llama-server", type=Path, default=None, metavar="PATH", help="a llama-server binary "
                    "to measure beside")
    ap.add_argument("--no-gemma", action="store_true", help="do not look for Gemma 3 270M")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hydra-trio" / "bench")
    args = ap.parse_args(argv)
    q = args.quick
    counts = [int(x) for x in (args.streams or ("1,8" if q else "1,8,64")).split(",")]
    tokens = args.tokens or (16 if q else 128)
    rounds = 1 if q else 2
    repeats = 1 if q else 3
    handoff_tokens = 256 if q else 4096
    # Whole MiB (figure 2 seeds its prompt with the size): 128 MiB = 134 MB. A bench token is
    # 36 KB of KV (128 MiB = 3641 tokens in a 6144-cell slot); a tiny one 256 B (1 MiB = 4096).
    restore_mb = 1 if q else 128
    pair_ctx = 10240 if q else 12288  # 2 slots

    out: Path = args.outdir
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget_s)
    run.data["config"] = {
        "preset": args.preset, "quick": q, "streams": counts, "tokens": tokens, "rounds": rounds,
        "repeats": repeats, "handoff_tokens": handoff_tokens, "restore_mb": restore_mb, "threads": args.threads,
        "gpu_flags": GPU_FLAGS, "llama_server": str(args.llama_server) if args.llama_server else None,
    }
    if args.llama_server is not None and not args.llama_server.is_file():
        run.data["config"]["llama_server"] = f"{args.llama_server}: no such file (skipped)"
        args.llama_server = None
    from benchmarks.__main__ import build_models

    args.cache.mkdir(parents=True, exist_ok=True)
    models = {args.preset: build_models(args.cache, [args.preset])[args.preset]}
    if not args.no_gemma:
        from hydra_trio.model.registry import ModelPackageMissing, named_model_path

        try:
            models["gemma3-270m"] = str(named_model_path("gemma3-270m"))
        except ModelPackageMissing as exc:
            run.data["gemma3-270m"] = f"skipped: not installed ({exc})"
            print(f"Gemma 3 270M not installed: skipped ({exc})", flush=True)
    run.save()

    for label, path in models.items():
        run.data["models"][label] = {"path": path}
        # Gemma's KV is smaller per token (18 KB): its 128 MiB needs longer slots.
        ctx = pair_ctx if label != "gemma3-270m" or q else 32768
        run.step(
            label,
            "streams",
            30,
            lambda p=path: fig_streams(p, counts, tokens, rounds, args.threads, log_dir, args.llama_server),
        )
        if run.left_s() < 40:
            run.data["models"][label]["pair"] = {"skipped": "out of time"}
            continue
        try:
            fig_pair(run, label, path, ctx, args.threads, log_dir, handoff_tokens, restore_mb, repeats)
        except Exception as exc:
            run.data["models"][label]["pair"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{label}] engine pair: FAILED {type(exc).__name__}: {exc}", flush=True)
    run.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    run.save()
    print("\n".join(headline(run.data)))
    print(f"wrote {run.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
