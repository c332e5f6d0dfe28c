"""`python -m benchmarks [--quick] [--name NAME] [--only fig,...]`

Generates the bench-preset model, starts real engines on loopback (separate processes),
drives them with the project's clients, prints a table, writes benchmarks/results/NAME.json
and PNG plots. Every figure is a ratio of two things measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import figures as F
from .harness import EngineProcess, env_info, fmt_summary, free_port, wait_http
from .llama_server import LlamaServer, find_or_build
from .plots import plot_all

RESULTS = Path(__file__).resolve().parent / "results"


def build_models(cache: Path, presets: list[str]) -> dict[str, str]:
    from hydra_trio.model.synthetic import write_model

    out = {}
    for p in presets:
        path = cache / f"{p}.gguf"
        if not path.exists():
            print(f"writing {p} model ...", flush=True)
            write_model(path, p, seed=0)
        out[p] = str(path)
    return out


def start_llama_cpp_server(model: str, ctx: int, log_dir: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        print("llama_cpp.server not installed (pip install 'llama-cpp-python[server]'): skipping that comparison")
        return None
    port = free_port()
    log = open(log_dir / "llama_cpp_server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", model, "--n_ctx", str(ctx), "--n_threads", "2",
         "--host", "127.0.0.1", "--port", str(port),
         # By default a new request interrupts the running one; queue them instead.
         "--interrupt_requests", "False"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", proc, timeout=300)
    return proc, url


def _peer(results: dict[str, Any], name: str, start: Any) -> Any:
    """Run a comparison peer's step; a failure is recorded and skipped, never a crash that
    would lose the other figures."""
    try:
        return start()
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}; skipping that comparison", flush=True)
        results.setdefault("skipped", {})[name] = f"{type(exc).__name__}: {exc}"
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="under 3 minutes on 2 CPU cores")
    ap.add_argument("--name", default=None, help="results file name (default: quick or full)")
    ap.add_argument("--only", default="", help="comma list: "
                    "presets,handoff,restore,generation,cancel,concurrency,memory")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "hydra-trio" / "bench"))
    ap.add_argument("--with-llama-server", action="store_true", help="compare with llama.cpp's llama-server, building "
                    "it once (~10 min) if needed")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="an existing llama-server "
                    "binary to compare with")
    args = ap.parse_args(argv)
    quick = args.quick
    name = args.name or ("quick" if quick else "full")
    only = set(filter(None, args.only.split(",")))
    def want(f):
        return (not only or f in only)

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    log_dir = RESULTS / f"{name}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    llama_server = find_or_build(args.llama_server, args.with_llama_server)
    presets = ["tiny", "small", "bench"] if want("presets") else ["bench"]
    models = build_models(cache, presets)
    bench = models["bench"]
    cfg = {
        "handoff_sizes": [256, 1024, 4096],
        "handoff_repeats": 2 if quick else 5,
        "restore_mb": [1, 16, 128] if quick else [1, 16, 128, 256],
        "restore_repeats": 3 if quick else 5,
        "gen_tokens": 64 if quick else 256,
        "gen_repeats": 2 if quick else 9,
        "cancels": 20,
        "cancel_prefill_tokens": 4096,
        "concurrency": [1, 2, 4, 8],
        "concurrency_tokens": 32 if quick else 128,
        "concurrency_repeats": 1 if quick else 5,
        "memory_mb": 128 if quick else 256,
        "memory_repeats": 2 if quick else 3,
    }
    results: dict[str, Any] = {
        "name": name,
        "quick": quick,
        "config": cfg,
        "env": env_info(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    t_start = time.perf_counter()

    if want("presets"):
        print("presets ...", flush=True)
        results["presets"] = F.fig_presets(models, log_dir, 64)

    tok = F.Tokenizer(bench)
    # Each slot holds the largest prompt handed off or blob restored (256 MB of bench KV is
    # ~7,300 positions) in the default split KV cache, where a slot gets ctx_size / slots.
    per_slot = 8192
    a = EngineProcess(bench, slots=2, ctx_size=2 * per_slot)
    b = EngineProcess(bench, slots=8, ctx_size=8 * per_slot)
    try:
        a.start(log_dir, "engine-a")
        b.start(log_dir, "engine-b")
        if want("handoff"):
            print("1. hand-off vs recompute ...", flush=True)
            results["handoff"] = F.fig_handoff(a, b, tok, cfg["handoff_sizes"], cfg["handoff_repeats"])
            if llama_server:
                print("1. ... against llama-server's slot save/restore", flush=True)
                _peer(results, "handoff_llama_server", lambda: F.fig_handoff_llama_server(
                    results["handoff"], b, tok, llama_server, bench, cfg["handoff_repeats"], log_dir))
        if want("restore"):
            print("2. restore path vs its limits ...", flush=True)
            results["restore"] = F.fig_restore(a, b, tok, cfg["restore_mb"], cfg["restore_repeats"], bench)
        if want("generation"):
            print("3. generation overhead ...", flush=True)
            results["generation"] = F.fig_generation(b, tok, cfg["gen_tokens"], cfg["gen_repeats"], bench)
        if want("cancel"):
            print("4. cancellation ...", flush=True)
            results["cancel"] = F.fig_cancel(b, tok, cfg["cancels"], cfg["cancel_prefill_tokens"])
        if want("memory"):
            print("6. memory ...", flush=True)
            results["memory"] = F.fig_memory(a, b, tok, cfg["memory_mb"], cfg["memory_repeats"])
        a.stop()
        if want("concurrency"):
            print("5. concurrency ...", flush=True)
            peers: dict[str, str] = {}
            servers: list[Any] = []
            try:
                started = _peer(results, "llama_cpp_server", lambda: start_llama_cpp_server(bench, 4096, log_dir))
                if started:
                    servers.append(started[0])
                    peers["llama_cpp_server"] = started[1]
                if llama_server:
                    ls = _peer(
                        results,
                        "llama_server",
                        lambda: LlamaServer(
                            llama_server, bench, ctx=8192, slots=8, log_dir=log_dir, tag="llama-server-p5"
                        ),
                    )
                    if ls:
                        servers.append(ls)
                        peers["llama_server"] = ls.url
                results["concurrency"] = F.fig_concurrency(
                    b, cfg["concurrency"], cfg["concurrency_tokens"], peers, cfg["concurrency_repeats"]
                )
            finally:
                for server in servers:
                    if isinstance(server, LlamaServer):
                        server.stop()
                    else:
                        server.terminate()
                        server.wait()
    finally:
        a.stop()
        b.stop()
    results["wall_s"] = time.perf_counter() - t_start
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(results, indent=2))
    table = render_table(results)
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(table)
    plots = plot_all(results, RESULTS, name)
    print(f"\nwrote {out}, {RESULTS / (name + '.md')} and {len(plots)} plots in {results['wall_s']:.0f} s")
    return 0


def render_table(r: dict[str, Any]) -> str:
    lines = ["| figure | measured | against | ratio (median [min–max]) |", "|---|---|---|---|"]
    if "presets" in r:
        for p, row in r["presets"]["rows"].items():
            lines.append(f"| preset {p} | load {row['load_ms']:.0f} ms, {fmt_summary(row['tokens_per_s'])} tok/s "
                         "greedy | | |")
    for _n, row in r.get("handoff", {}).items():
        lines.append(
            f"| 1. TTFT, {row['n_past']}-token prompt ({row['kv_bytes'] / 1e6:.0f} MB KV) | hand-off "
            f"{fmt_summary(row['handoff_ttft_ms'], ' ms')} "
            f"| recompute {fmt_summary(row['recompute_ttft_ms'], ' ms')} "
            f"| **{fmt_summary(row['speedup'], '×')}** faster |"
        )
    for _mb, row in r.get("restore", {}).items():
        lines.append(
            f"| 2. DECODE ack, {row['blob_bytes'] / 1e6:.0f} MB blob | {fmt_summary(row['decode_ack_ms'], ' ms', 2)} "
            f"| in-process set_data {fmt_summary(row['inprocess_set_data_ms'], ' ms', 2)} | "
            f"{fmt_summary(row['ack_over_set_data'], '×')} |"
        )
        lines.append(
            f"| 2. STATE_PUT throughput, {row['blob_bytes'] / 1e6:.0f} MB | "
            f"{fmt_summary(row['state_put_MBps'], ' MB/s', 0)} "
            f"| raw loopback {fmt_summary(row['raw_loopback_MBps'], ' MB/s', 0)} | "
            f"{fmt_summary(row['put_over_raw'], '×', 2)} |"
        )
    if "generation" in r:
        g = r["generation"]
        lines.append(
            f"| 3. one DECODE over SSE | {fmt_summary(g['decode_sse_tokens_per_s'], ' tok/s')} | plain "
            "llama-cpp-python loop "
            f"{fmt_summary(g['plain_loop_tokens_per_s'], ' tok/s')} | {fmt_summary(g['ours_over_plain'], '×', 2)} |"
        )
    for phase, row in r.get("cancel", {}).items():
        lines.append(
            f"| 4. DELETE during {phase.replace('_', ' ')} | {fmt_summary(row['delete_ms'], ' ms')} (max "
            f"{row['delete_ms_max']:.1f}) "
            f"| tokens evaluated after the reply | max {row['tokens_after_reply_max']:.0f} |"
        )
    for _n, row in r.get("handoff", {}).items():
        peer = row.get("llama_server_restore")
        if peer:
            lines.append(
                f"| P1. TTFT, {row['n_past']}-token prompt | hand-off {row['handoff_ttft_ms']['median']:.1f} ms "
                "| llama-server slot restore + first token "
                f"{fmt_summary(peer['ttft_ms'], ' ms')} ({peer['n_prompt']} tokens) "
                f"| **{row['handoff_over_llama_server']:.2f}×** the time |"
            )
    for k, row in r.get("concurrency", {}).items():
        ours, chat = row["ours_decode"], row["ours_chat"]
        lines.append(
            f"| 5. {k} concurrent | DECODE {ours['aggregate_tokens_per_s']:.0f} tok/s; chat "
            f"{chat['aggregate_tokens_per_s']:.0f} tok/s, "
            f"ITL p50 {chat['itl_p50_ms']:.0f} / p99 {chat['itl_p99_ms']:.0f} ms | streams alone (first token to "
            "last): DECODE "
            f"{ours.get('stream_tokens_per_s', float('nan')):.0f}, chat "
            f"{chat.get('stream_tokens_per_s', float('nan')):.0f} tok/s "
            "| DECODE / chat **"
            f"{ours.get('stream_tokens_per_s', float('nan')) / chat.get('stream_tokens_per_s', float('nan')):.2f}×** |"
        )
        for peer, label in (("llama_server", "llama-server (C++)"), ("llama_cpp_server", "llama_cpp.server")):
            other = row.get(f"{peer}_chat")
            if other:
                lines.append(
                    f"| 5. {k} concurrent vs {label} | chat {chat['aggregate_tokens_per_s']:.0f} tok/s | {label} "
                    f"{other['aggregate_tokens_per_s']:.0f} tok/s, ITL p50 {other['itl_p50_ms']:.0f} / p99 "
                    f"{other['itl_p99_ms']:.0f} ms "
                    f"| **{fmt_summary(row[f'ours_chat_over_{peer}'], '×', 2)}** |"
                )
    if "memory" in r:
        m = r["memory"]
        lines.append(f"| 6. peak RSS growth receiving a {m['blob_bytes'] / 1e6:.0f} MB blob | | blob size | "
                     f"{fmt_summary(m['peak_rss_growth_over_blob'], '×', 2)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
