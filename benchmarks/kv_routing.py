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

``--schedule rounds`` sends turn t of every session before any session's turn t+1, so
between two turns of a session the other sessions pass through the engines: with few
slots (``--slots 2``) histories leave the slots for the host prompt cache (RAM, published
as KV events of medium CPU) and the next turn finds them there, or not, depending on where
the router sends it. Each turn carries its own X-Request-Id, and the engines' JSON request
lines say which engine served it and how many of its cached tokens came from RAM
(``host_cached_tokens``): so each turn is counted as served from RAM, sent to the engine
that served the session's previous turn (the one holding its history, in a slot or in
RAM), or sent elsewhere. ``kv_aware_no_host_credit`` is ``kv_aware`` with
``--kv-penalty-host 0``: the router's index still holds the CPU blocks, but credits none.
"""

from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .harness import EngineProcess, free_port, metric_value, percentile, stream_chat, words_prompt
from .sessions import common_prefix_len, rendered, tokens_of

POLICIES = ("round_robin", "cache_aware", "kv_aware")
# The router's arguments for each run name (start_router adds the rest).
ROUTER_ARGS: dict[str, list[str]] = {
    "round_robin": ["--policy", "round_robin"],
    "cache_aware": ["--policy", "cache_aware"],
    "kv_aware": ["--policy", "kv_aware"],
    "kv_aware_no_host_credit": ["--policy", "kv_aware", "--kv-penalty-host", "0"],
}
SCHEDULES = ("sessions", "rounds")
N_ENGINES = 3
PROMPT_CACHE_COUNTERS = ("saved", "restored", "restored_tokens", "evicted")
# vllm-router's kv_aware decision line (policies/kv_aware.rs, at --log-level debug).
_DECISION = re.compile(r"KV prefix "
                       r"decision.*?worker=\"?(?P<worker>[^\s\"]+)\"?.*?credited_prefix_tokens=(?P<credit>\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the router colours its log even into a file


def engine_prompt_work(url: str) -> float:
    """hydra_engine_prompt_tokens_processed_total: every prompt token the engine evaluated."""
    return metric_value(url, "hydra_engine_prompt_tokens_processed_total")


def prompt_cache_counters(url: str) -> dict[str, float]:
    """The engine's host prompt cache counters (hydra_prompt_cache_*_total)."""
    return {k: metric_value(url, f"hydra_prompt_cache_{k}_total") for k in PROMPT_CACHE_COUNTERS}


def request_lines(log: Path) -> dict[str, dict[str, Any]]:
    """An engine's JSON request lines by request id."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("request_id") and rec.get("route") == "chat":
            out[rec["request_id"]] = rec
    return out


def router_decisions(log: Path, urls: list[str]) -> list[dict[str, Any]]:
    """kv_aware's decisions in the router's log: the engine chosen and the prefix tokens
    its index credited there (device blocks, plus host blocks at --kv-penalty-host)."""
    out = []
    for m in _DECISION.finditer(_ANSI.sub("", log.read_text(errors="replace"))):
        worker = m["worker"]
        out.append({"engine": urls.index(worker) if worker in urls else None, "credited": int(m["credit"])})
    return out


@dataclass
class Session:
    i: int
    conv: list[dict[str, str]]
    last_full: list[int] = field(default_factory=list)  # the previous prompt and answer, as tokens
    rows: list[dict[str, Any]] = field(default_factory=list)


def run_policy(
    policy: str, model: str, log_dir: Path, *, sessions: int, turns: int, clients: int, n_predict: int,
    start_router: Any, slots: int = 4, cache_ram_mib: int | None = None, schedule: str = "sessions",
) -> dict[str, Any]:
    engines = []
    kv = "kv_aware" in ROUTER_ARGS[policy]
    try:
        for i in range(N_ENGINES):
            pub, replay = free_port(), free_port()
            extra = ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
                     # Request lines as JSON: which engine served each turn, and from which tier.
                     "--log-level", "INFO", "--log-format", "json"]
            if cache_ram_mib is not None:
                extra += ["--cache-ram-mib", str(cache_ram_mib)]
            e = EngineProcess(model, slots=slots, ctx_size=slots * 2048, threads=1, extra=extra)
            engines.append((e.start(log_dir, f"multi-turn-{policy}-{i}"), pub, replay))
        urls = [e.url for e, _, _ in engines]
        args = [*ROUTER_ARGS[policy], "--worker-urls", *urls]
        if kv:
            args += ["--kv-event-model", "hydra", "--log-level", "debug"]  # debug: its decisions, logged
            for e, pub, replay in engines:
                args += ["--kv-event-source", f"{e.url}=tcp://127.0.0.1:{pub}",
                         "--kv-event-replay-source", f"{e.url}=tcp://127.0.0.1:{replay}"]
        router_name = f"router-multi-turn-{policy}"
        router_proc, router = start_router(args, log_dir, router_name)
        run_id = uuid.uuid4().hex[:8]
        try:
            before = sum(engine_prompt_work(u) for u in urls)
            tokenizer = httpx.Client(base_url=urls[0], timeout=60)

            def one_turn(s: Session, turn: int) -> None:
                rid = f"mt-{run_id}-{s.i}-{turn}"
                seconds, answer, final = stream_chat(router, s.conv, n_predict, headers={"X-Request-Id": rid})
                usage = final["usage"]
                prompt_text = rendered(tokenizer, s.conv)
                prompt_tokens = tokens_of(tokenizer, prompt_text)
                s.rows.append({"session": s.i, "turn": turn, "request_id": rid, "ttft_ms": seconds * 1000.0,
                               "prompt_tokens": usage["prompt_tokens"],
                               "cached": usage["prompt_tokens_details"]["cached_tokens"],
                               "oracle_cached": common_prefix_len(s.last_full, prompt_tokens)})
                s.last_full = tokens_of(tokenizer, prompt_text + answer)
                s.conv += [{"role": "assistant", "content": answer},
                           {"role": "user", "content": words_prompt(20, seed=9000 + 100 * s.i + turn) + "?"}]

            def whole(s: Session) -> None:
                for turn in range(turns):
                    one_turn(s, turn)

            all_sessions = [
                Session(i, [{"role": "user", "content": f"session {i}: " + words_prompt(200, seed=7000 + i)}])
                for i in range(sessions)
            ]
            with ThreadPoolExecutor(clients) as pool:
                if schedule == "sessions":
                    list(pool.map(whole, all_sessions))
                else:  # rounds: turn t of every session, then turn t+1
                    for turn in range(turns):
                        list(pool.map(lambda s, t=turn: one_turn(s, t), all_sessions))
            computed = sum(engine_prompt_work(u) for u in urls) - before
            caches = [prompt_cache_counters(u) for u in urls]
            tokenizer.close()
        finally:
            router_proc.terminate()
            router_proc.wait(timeout=15)
    finally:
        for e, _, _ in engines:
            e.stop()
    served = [request_lines(e.log_path) for e, _, _ in engines if e.log_path is not None]
    rows = []
    for s in all_sessions:
        holder = None  # the engine that served the session's previous turn: it holds the history
        for r in s.rows:
            where = [i for i, lines in enumerate(served) if r["request_id"] in lines]
            r["engine"] = where[0] if len(where) == 1 else None
            r["host_cached"] = served[where[0]][r["request_id"]]["host_cached_tokens"] if len(where) == 1 else None
            r["holder"] = holder
            holder = r["engine"]
            rows.append(r)
    prompt = sum(r["prompt_tokens"] for r in rows)
    later = [r for r in rows if r["turn"] > 0]
    from_ram = [r for r in rows if r["host_cached"]]
    decisions = router_decisions(log_dir / f"{router_name}.log", urls) if kv else []
    return {
        "policy": policy,
        "router_args": ROUTER_ARGS[policy],
        "prompt_tokens": prompt,
        "computed": computed,
        "oracle_computed": prompt - sum(r["oracle_cached"] for r in rows),
        "cached_share": sum(r["cached"] for r in rows) / prompt,
        "ttft_p50_ms": percentile([r["ttft_ms"] for r in rows], 50),
        "ttft_p99_ms": percentile([r["ttft_ms"] for r in rows], 99),
        "later_ttft_p50_ms": percentile([r["ttft_ms"] for r in later], 50),
        "turns": len(rows),
        "later_turns": len(later),
        "turns_attributed": sum(r["engine"] is not None for r in rows),
        "later_to_holder": sum(r["engine"] is not None and r["engine"] == r["holder"] for r in later),
        "later_elsewhere": sum(r["engine"] is not None and r["engine"] != r["holder"] for r in later),
        "from_ram_turns": len(from_ram),
        "from_ram_to_holder": sum(r["engine"] == r["holder"] for r in from_ram),
        "from_ram_tokens": sum(r["host_cached"] for r in from_ram),
        "from_ram_ttft_p50_ms": percentile([r["ttft_ms"] for r in from_ram], 50) if from_ram else None,
        "prompt_cache": caches,
        "router_decisions": len(decisions),
        "router_decisions_credited": sum(d["credited"] > 0 for d in decisions),
        "router_credited_tokens": sum(d["credited"] for d in decisions),
        "rows": rows,
    }


def multi_turn(model: str, log_dir: Path, out: Path, *, sessions: int, turns: int, clients: int, n_predict: int,
               start_router: Any, slots: int = 4, cache_ram_mib: int | None = None, schedule: str = "sessions",
               policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    runs = [run_policy(p, model, log_dir, sessions=sessions, turns=turns, clients=clients, n_predict=n_predict,
                       start_router=start_router, slots=slots, cache_ram_mib=cache_ram_mib, schedule=schedule)
            for p in policies]
    oracle = runs[0]["oracle_computed"]  # the same requests for every policy (greedy, same seeds)
    base = runs[0]
    lines = [f"{sessions} sessions x {turns} turns ({schedule}), {clients} clients at once, "
             f"{N_ENGINES} engines x {slots} slots, cache-ram-mib "
             f"{cache_ram_mib if cache_ram_mib is not None else 'default'}",
             f"| policy | prompt tokens computed (x oracle) | cached share | TTFT p50 / p99 (x {base['policy']} p50) "
             "| later turns to the history's engine / elsewhere | turns served from RAM (tokens) | router decisions "
             "crediting a prefix |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        credited = f"{r['router_decisions_credited']} / {r['router_decisions']}" if r["router_decisions"] else "-"
        lines.append(f"| {r['policy']} | {r['computed']:.0f} ({r['computed'] / r['oracle_computed']:.2f}x) | "
                     f"{r['cached_share']:.1%} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} ms "
                     f"({r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x) | {r['later_to_holder']} / "
                     f"{r['later_elsewhere']} "
                     f"of {r['later_turns']} | {r['from_ram_turns']} ({r['from_ram_tokens']}) | {credited} |")
    lines.append(f"oracle: {oracle:.0f} prompt tokens computed")
    for r in runs:
        lines.append(f"{r['policy']}: prompt cache per engine " + "; ".join(
            ", ".join(f"{k} {v:.0f}" for k, v in c.items()) for c in r["prompt_cache"]))
    kv = next((r for r in runs if r["policy"] == "kv_aware"), None)
    rr = next((r for r in runs if r["policy"] == "round_robin"), None)
    if kv is not None:
        lines.append(f"goal kv_aware computed <= 1.1x oracle: {kv['computed'] / kv['oracle_computed']:.2f}x "
                     f"{'met' if kv['computed'] <= 1.1 * kv['oracle_computed'] else 'NOT met'}")
    if kv is not None and rr is not None:
        lines.append(f"goal kv_aware TTFT p50 <= 0.5x round_robin: {kv['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f}x "
                     f"{'met' if kv['ttft_p50_ms'] <= 0.5 * rr['ttft_p50_ms'] else 'NOT met'}")
    result = {"sessions": sessions, "turns": turns, "clients": clients, "n_predict": n_predict, "model": model,
              "slots": slots, "cache_ram_mib": cache_ram_mib, "schedule": schedule, "engines": N_ENGINES,
              "runs": runs, "table": "\n".join(lines)}
    out.write_text(json.dumps(result, indent=1))
    print("\n".join(lines), flush=True)
    print(f"wrote {out}")
    return result
