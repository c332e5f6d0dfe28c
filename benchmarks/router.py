"""`python -m benchmarks.router [--workload pd|multi-turn|all] [--preset bench] [--tokens 2048] [--repeats 3]`

``--workload multi-turn`` (benchmarks/kv_routing.py): a multi-turn chat workload over three
engines with the router's round_robin, cache_aware and kv_aware (KV events) policies.

``--workload pd``: TTFT through vllm-router for one long prompt: P/D hand-off (``--vllm-pd-disaggregation``:
prefill engine P exports the KV, decode engine D pulls it over KV_PULL) against plain
routing (``--worker-urls D``: D recomputes the prompt). Engines and routers are separate
processes on loopback; every repeat uses a new prompt, so no engine finds it cached.

Also measured, per repeat: the prompt tokens D computed, D's pull and restore time, and
what an export costs the prefill engine's slot (a direct do_remote_decode request to P:
prefill, then the copy into host memory, then the slot is free).
Writes benchmarks/results/router-<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from .__main__ import RESULTS, build_models
from .harness import (
    EngineProcess,
    env_info,
    fmt_summary,
    free_port,
    metric_value,
    stream_chat,
    summary,
    wait_http,
    words_prompt,
)

PD_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}


def router_binary() -> str:
    beside = Path(sys.executable).parent / "vllm-router"  # the venv's console script
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise SystemExit("vllm-router is not installed: pip install vllm-router")
    return found


def start_router(args: list[str], log_dir: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(log_dir / f"{name}.log", "wb")
    proc = subprocess.Popen(
        [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
         "--policy", "round_robin", "--disable-retries", "--log-level", "warning", *args],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readiness", proc, timeout=120)
    return proc, url


def ttft(router: str, text: str, n_predict: int) -> tuple[float, dict[str, Any]]:
    """(seconds from sending to the first content token, the final chunk)."""
    seconds, _, final = stream_chat(router, [{"role": "user", "content": text}], n_predict)
    return seconds, final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (words; ~1 token each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "hydra-trio" / "bench"))
    ap.add_argument("--workload", default="all", choices=["pd", "multi-turn", "all"])
    ap.add_argument("--multi-turn-model", default="small", help="multi-turn: a synthetic preset, a GGUF path or "
                    "gemma3-270m")
    ap.add_argument("--sessions", type=int, default=12, help="multi-turn: sessions")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    ap.add_argument("--clients", type=int, default=3, help="multi-turn: sessions running at once")
    ap.add_argument("--n-predict", type=int, default=16, help="multi-turn: tokens per answer")
    ap.add_argument("--slots", type=int, default=4, help="multi-turn: slots per engine")
    ap.add_argument("--cache-ram-mib", type=int, default=None, help="multi-turn: the engines' host prompt cache "
                    "(default: theirs)")
    ap.add_argument("--schedule", default="sessions", choices=["sessions", "rounds"],
                    help="multi-turn: each client runs whole sessions, or turn t of every session goes before turn t+1")
    ap.add_argument("--policies", default="round_robin,cache_aware,kv_aware",
                    help="multi-turn: runs, comma-separated (round_robin, cache_aware, kv_aware, "
                    "kv_aware_no_host_credit)")
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    if args.workload in ("multi-turn", "all"):
        from .kv_routing import ROUTER_ARGS, multi_turn

        m = args.multi_turn_model
        if m in ("tiny", "small", "bench"):
            model = build_models(cache, [m])[m]
        else:
            from hydra_trio.model.registry import resolve_model_arg

            model = str(resolve_model_arg(m)[0])
        log_dir = RESULTS / "router-multi-turn-logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        name = Path(model).stem
        if (args.schedule, args.slots) != ("sessions", 4):  # the default run keeps its file name
            name += f"-{args.schedule}-{args.sessions}x{args.slots}slots"
        policies = tuple(args.policies.split(","))
        unknown = set(policies) - set(ROUTER_ARGS)
        if unknown:
            ap.error(f"--policies: unknown {sorted(unknown)}; known: {', '.join(ROUTER_ARGS)}")
        multi_turn(model, log_dir, RESULTS / f"router-multi-turn-{name}.json", sessions=args.sessions, turns=args.turns,
                   clients=args.clients, n_predict=args.n_predict, start_router=start_router, slots=args.slots,
                   cache_ram_mib=args.cache_ram_mib, schedule=args.schedule, policies=policies)
        if args.workload == "multi-turn":
            return 0
    model = build_models(cache, [args.preset])[args.preset]
    log_dir = RESULTS / f"router-{args.preset}-logs"  # ignored by git, like the other runs' logs
    log_dir.mkdir(parents=True, exist_ok=True)
    # The chat template adds a few tokens; the prompt is sized in words so it stays ~2k tokens.
    n_words = args.tokens - 16
    p = EngineProcess(model, slots=2, ctx_size=4 * args.tokens).start(log_dir, "router-prefill")
    d = EngineProcess(model, slots=2, ctx_size=4 * args.tokens).start(log_dir, "router-decode")
    procs: list[subprocess.Popen[bytes]] = []
    rows: dict[str, list[float]] = {k: [] for k in (
        "pd_ttft_ms", "plain_ttft_ms", "pd_decode_prompt_tokens", "plain_decode_prompt_tokens",
        "pull_ms", "restore_ms", "kv_mb", "export_prefill_ms", "export_copy_ms", "export_slot_held_ms")}
    prompt_tokens = 0
    try:
        pd_proc, pd = start_router(
            ["--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url], log_dir, "router-pd"
        )
        plain_proc, plain = start_router(["--worker-urls", d.url], log_dir, "router-plain")
        procs += [pd_proc, plain_proc]
        ttft(plain, words_prompt(64, seed=999), 4)  # warm both engines and both routers
        ttft(pd, words_prompt(64, seed=998), 4)
        for i in range(args.repeats):
            for name, router in (("pd", pd), ("plain", plain)):
                before = metric_value(d.url, "hydra_engine_prompt_tokens_processed_total")
                seconds, final = ttft(router, words_prompt(n_words, seed=2 * i + (name == "plain")), 8)
                rows[f"{name}_ttft_ms"].append(seconds * 1000.0)
                rows[f"{name}_decode_prompt_tokens"].append(
                    metric_value(d.url, "hydra_engine_prompt_tokens_processed_total") - before
                )
                prompt_tokens = final["usage"]["prompt_tokens"]
                if name == "pd":
                    kv = final["kv_transfer"]
                    assert kv["status"] == "restored", kv
                    rows["pull_ms"].append(kv["pull_ms"])
                    rows["restore_ms"].append(kv["restore_ms"])
                    rows["kv_mb"].append(kv["kv_bytes"] / 1e6)
            # What an export costs the prefill engine's slot (the export expires unpulled).
            body = httpx.post(p.url + "/v1/chat/completions", timeout=600, json={
                "messages": [{"role": "user", "content": words_prompt(n_words, seed=1000 + i)}],
                "max_tokens": 1, "temperature": 0, "kv_transfer_params": PD_PARAMS}).json()
            rows["export_prefill_ms"].append(body["kv_export"]["prefill_ms"])
            rows["export_copy_ms"].append(body["kv_export"]["copy_ms"])
            rows["export_slot_held_ms"].append(body["kv_export"]["slot_held_ms"])
            print(f"repeat {i + 1}/{args.repeats}: P/D {rows['pd_ttft_ms'][-1]:.0f} ms, "
                  f"plain {rows['plain_ttft_ms'][-1]:.0f} ms", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=15)
        p.stop()
        d.stop()
    stats = {k: summary(v) for k, v in rows.items()}
    result = {"preset": args.preset, "prompt_tokens": prompt_tokens, "repeats": args.repeats,
              "stats": stats, "raw": rows, "env": env_info()}
    out = RESULTS / f"router-{args.preset}.json"
    out.write_text(json.dumps(result, indent=1))
    s = stats
    print(f"\npreset {args.preset}, {prompt_tokens}-token prompt, {args.repeats} repeats (median [min–max])")
    print("| figure | P/D hand-off via vllm-router | plain routing (recompute) |")
    print("|---|---|---|")
    print(f"| TTFT through the router | {fmt_summary(s['pd_ttft_ms'], ' ms', 0)} | "
          f"{fmt_summary(s['plain_ttft_ms'], ' ms', 0)} |")
    print(f"| prompt tokens the decode engine computed | {s['pd_decode_prompt_tokens']['median']:.0f} | "
          f"{s['plain_decode_prompt_tokens']['median']:.0f} |")
    print(f"| KV pull + restore on the decode engine | {fmt_summary(s['pull_ms'], ' ms')} + "
          f"{fmt_summary(s['restore_ms'], ' ms')} ({s['kv_mb']['median']:.0f} MB) | |")
    print(f"| export on the prefill engine: prefill, copy out, slot held | "
          f"{fmt_summary(s['export_prefill_ms'], ' ms', 0)}, {fmt_summary(s['export_copy_ms'], ' ms')}, "
          f"{fmt_summary(s['export_slot_held_ms'], ' ms', 0)} | |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
