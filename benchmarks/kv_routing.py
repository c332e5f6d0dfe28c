"""Multi-turn chat over three engines behind vllm-router: how each routing policy does with
what the engines cache (``python -m benchmarks.router --workload multi-turn``).

Every session opens with a long message and adds a short question per turn; a few clients
run sessions at once, each session's turns one after another (a turn waits for the last
answer). Policies, each on fresh engines (nothing cached from the previous one):
``round_robin``; ``cache_aware``, the router's guess from request text; ``kv_aware``, on the
engines' KV events (``--kv-events-endpoint``). Figures: prompt tokens the engines computed,
against an oracle's (an engine that holds every history computes only each turn's new
tokens), the share of prompt tokens served from cache, and TTFT through the router.
Goals (issue "Many engines as one cache", item 4): ``kv_aware`` computes <= 1.1x the
oracle's prompt tokens, and its TTFT p50 is <= 0.5x ``round_robin``'s.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from .harness import EngineProcess, free_port, metric_value, percentile, stream_chat, words_prompt
from .sessions import common_prefix_len, rendered, tokens_of

POLICIES = ("round_robin", "cache_aware", "kv_aware")


def engine_prompt_work(url: str) -> float:
    """hydra_engine_prompt_tokens_processed_total: every prompt token the engine evaluated."""
    return metric_value(url, "hydra_engine_prompt_tokens_processed_total")


def run_policy(
    policy: str, model: str, log_dir: Path, *, sessions: int, turns: int, clients: int, n_predict: int,
    start_router: Any,
) -> dict[str, Any]:
    engines = []
    try:
        for i in range(3):
            pub, replay = free_port(), free_port()
            extra = ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
            e = EngineProcess(model, slots=4, ctx_size=4 * 2048, threads=1, extra=extra)
            engines.append((e.start(log_dir, f"multi-turn-{policy}-{i}"), pub, replay))
        args = ["--policy", policy, "--worker-urls", *[e.url for e, _, _ in engines]]
        if policy == "kv_aware":
            args += ["--kv-event-model", "hydra"]
            for e, pub, replay in engines:
                args += ["--kv-event-source", f"{e.url}=tcp://127.0.0.1:{pub}",
                         "--kv-event-replay-source", f"{e.url}=tcp://127.0.0.1:{replay}"]
        router_proc, router = start_router(args, log_dir, f"router-multi-turn-{policy}")
        try:
            before = sum(engine_prompt_work(e.url) for e, _, _ in engines)
            tokenizer = httpx.Client(base_url=engines[0][0].url, timeout=60)

            def one_session(i: int) -> list[dict[str, Any]]:
                conv = [{"role": "user", "content": f"session {i}: " + words_prompt(200, seed=7000 + i)}]
                last_full: list[int] = []  # the previous prompt and answer, as tokens
                rows = []
                for turn in range(turns):
                    seconds, answer, final = stream_chat(router, conv, n_predict)
                    usage = final["usage"]
                    prompt_text = rendered(tokenizer, conv)
                    prompt_tokens = tokens_of(tokenizer, prompt_text)
                    rows.append({"session": i, "turn": turn, "ttft_ms": seconds * 1000.0,
                                 "prompt_tokens": usage["prompt_tokens"],
                                 "cached": usage["prompt_tokens_details"]["cached_tokens"],
                                 "oracle_cached": common_prefix_len(last_full, prompt_tokens)})
                    last_full = tokens_of(tokenizer, prompt_text + answer)
                    conv += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": words_prompt(20, seed=9000 + 100 * i + turn) + "?"}]
                return rows

            with ThreadPoolExecutor(clients) as pool:
                rows = [r for rs in pool.map(one_session, range(sessions)) for r in rs]
            computed = sum(engine_prompt_work(e.url) for e, _, _ in engines) - before
            tokenizer.close()
        finally:
            router_proc.terminate()
            router_proc.wait(timeout=15)
    finally:
        for e, _, _ in engines:
            e.stop()
    prompt = sum(r["prompt_tokens"] for r in rows)
    later = [r["ttft_ms"] for r in rows if r["turn"] > 0]
    return {
        "policy": policy,
        "prompt_tokens": prompt,
        "computed": computed,
        "oracle_computed": prompt - sum(r["oracle_cached"] for r in rows),
        "cached_share": sum(r["cached"] for r in rows) / prompt,
        "ttft_p50_ms": percentile([r["ttft_ms"] for r in rows], 50),
        "ttft_p99_ms": percentile([r["ttft_ms"] for r in rows], 99),
        "later_ttft_p50_ms": percentile(later, 50),
        "rows": rows,
    }


def multi_turn(model: str, log_dir: Path, out: Path, *, sessions: int, turns: int, clients: int, n_predict: int,
               start_router: Any) -> dict[str, Any]:
    runs = [run_policy(p, model, log_dir, sessions=sessions, turns=turns, clients=clients, n_predict=n_predict,
                       start_router=start_router) for p in POLICIES]
    oracle = runs[0]["oracle_computed"]  # the same requests for every policy (greedy, same seeds)
    rr = next(r for r in runs if r["policy"] == "round_robin")
    lines = [f"{sessions} sessions x {turns} turns, {clients} clients at once, 3 engines x 4 slots",
             "| policy | prompt tokens computed (x oracle) | cached share | TTFT p50 / p99 (x round_robin p50) |",
             "|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['policy']} | {r['computed']:.0f} ({r['computed'] / r['oracle_computed']:.2f}x) | "
                     f"{r['cached_share']:.1%} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} ms "
                     f"({r['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f}x) |")
    kv = next(r for r in runs if r["policy"] == "kv_aware")
    lines.append(f"oracle: {oracle:.0f} prompt tokens computed")
    lines.append(f"goal kv_aware computed <= 1.1x oracle: {kv['computed'] / kv['oracle_computed']:.2f}x "
                 f"{'met' if kv['computed'] <= 1.1 * kv['oracle_computed'] else 'NOT met'}")
    lines.append(f"goal kv_aware TTFT p50 <= 0.5x round_robin: {kv['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f}x "
                 f"{'met' if kv['ttft_p50_ms'] <= 0.5 * rr['ttft_p50_ms'] else 'NOT met'}")
    result = {"sessions": sessions, "turns": turns, "clients": clients, "n_predict": n_predict, "model": model,
              "runs": runs, "table": "\n".join(lines)}
    out.write_text(json.dumps(result, indent=1))
    print("\n".join(lines), flush=True)
    print(f"wrote {out}")
    return result

