"""Agent-sized prompts (issue 43): cold prefill, later turns on a cached prefix, and the
inter-token latency of a stream beside a long prefill, hydra-trio against llama-server.

    python -m benchmarks.prefill [--quick] [--sizes 1024,4096,16384,30720] [--rounds 3]
                                 [--threads 1] [--llama-server PATH] [--skip cold,turns,itl]

Real model only (Gemma 3 270M, ``hydra_trio.model.registry``). Both engines run one llama
thread (``--threads``) and two slots of ``max size + 2048`` cells each (split KV, their
default), so the ITL part has a slot for the stream and one for the prompt. The machine is
shared, so every figure is a ratio of rounds run side by side: each round sends the same
prompt to both engines, the order alternating between rounds, and every round is printed.

- cold: a prompt of N tokens new to both (a fresh seed per round; llama-server with
  ``cache_prompt`` off), ``max_tokens`` 1: the wall time to the answer and the server's own
  ``timings.prompt_ms``.
- turns: a session with an N-token prefix (16k; 4k with --quick), then turns each adding
  200-500 new tokens, ``cache_prompt`` on: each later turn's TTFT and prompt tokens evaluated,
  beside a cold prefill of just that many tokens (the goal's "new tokens only" time).
- itl: a stream (short prompt, ``ignore_eos``) and, once it runs, an N-token prompt in the
  other slot: the stream's p50/p99 inter-token latency while that prompt prefills, and the
  prompt's own prefill time, against an as long prompt prefilled alone just before (the
  ``--itl-target-ms`` goal: beside a stream at most 1.1x alone).
- turns-pd: the session of ``turns`` through a P/D hand-off between two hydra-trio engines
  (PREFILL on one, DECODE on the other): each turn's TTFT to the decode engine's first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from .harness import EngineProcess, env_info, percentile, words_prompt
from .llama_server import LlamaServer, find_or_build

RESULTS = Path(__file__).resolve().parent / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Peer:
    """One engine under test: its URL, process and what its /v1/completions body needs."""

    def __init__(self, name: str, url: str, pid: int, extra: dict[str, Any]) -> None:
        self.name, self.url, self.pid, self.extra = name, url, pid, extra

    def cpu_s(self) -> float:
        """The server process's CPU seconds (all threads, user + system): unlike wall time,
        barely moved by other processes on a loaded machine (one llama thread spins on no
        barrier), so the side-by-side ratio of these is the steadier figure."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def complete(self, prompt: list[int], *, cache: bool, max_tokens: int = 1) -> tuple[float, dict[str, Any]]:
        """Wall seconds of one greedy completion and its ``timings`` (+ ``cpu_s``: the
        server's CPU seconds over the request)."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **self.extra}
        if self.name == "llama-server":
            body["cache_prompt"] = cache
        c0 = self.cpu_s()
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=1800)
        wall = time.perf_counter() - t0
        r.raise_for_status()
        return wall, {**(r.json().get("timings") or {}), "cpu_s": self.cpu_s() - c0}


def tokens(url: str, n: int, seed: int) -> list[int]:
    """``n`` token ids of seeded English-looking text (BOS first), tokenized by hydra-trio."""
    text = words_prompt(n + n // 4 + 16, seed=seed)
    r = httpx.post(url + "/tokenize", json={"content": text, "add_special": True}, timeout=120)
    r.raise_for_status()
    ids = [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]
    assert len(ids) >= n, (len(ids), n)
    return ids[:n]


def body_tokens(url: str, n: int, seed: int) -> list[int]:
    return tokens(url, n + 1, seed)[1:]  # a turn's addition: no BOS


def cold(peers: list[Peer], sizes: list[int], rounds: int, tok_url: str) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        for r in range(rounds):
            prompt = tokens(tok_url, n, seed=1000 * n + r)
            order = peers if r % 2 == 0 else peers[::-1]
            row: dict[str, Any] = {"n": n, "round": r}
            for p in order:
                wall, t = p.complete(prompt, cache=False)
                row[p.name] = {
                    "wall_s": wall,
                    "cpu_s": t["cpu_s"],
                    "prompt_ms": t.get("prompt_ms"),
                    "prompt_n": t.get("prompt_n"),
                }
            if len(peers) == 2:
                row["ratio"] = row["hydra-trio"]["wall_s"] / row["llama-server"]["wall_s"]
                row["cpu_ratio"] = row["hydra-trio"]["cpu_s"] / row["llama-server"]["cpu_s"]
            rows.append(row)
            print("cold " + _fmt(row, peers), flush=True)
    return rows


def turns(peers: list[Peer], prefix_n: int, n_turns: int, tok_url: str) -> list[dict[str, Any]]:
    """An agent-like session per engine (the same tokens): prefix, then turns of 200-500 new
    tokens; each later turn beside a cold prefill of as many tokens."""
    prefix = tokens(tok_url, prefix_n, seed=77)
    adds = [body_tokens(tok_url, 200 + (137 * k) % 301, seed=500 + k) for k in range(n_turns)]
    rows = []
    for p in peers:
        history = list(prefix)
        wall, t = p.complete(history, cache=True)
        rows.append(
            {"peer": p.name, "turn": 0, "n_prompt": len(history), "wall_s": wall, "prompt_n": t.get("prompt_n")}
        )
        print(f"turns {p.name}: turn 0 ({len(history)} tokens) {wall:.2f}s", flush=True)
        for k, add in enumerate(adds, start=1):
            history += add
            wall, t = p.complete(history, cache=True)
            fresh = tokens(tok_url, len(add), seed=900 + k)
            alone, _ = p.complete(fresh, cache=False)
            row = {
                "peer": p.name,
                "turn": k,
                "n_prompt": len(history),
                "n_new": len(add),
                "wall_s": wall,
                "cpu_s": t["cpu_s"],
                "prompt_n": t.get("prompt_n"),
                "prompt_ms": t.get("prompt_ms"),
                "cold_new_s": alone,
                "ratio_to_new": wall / alone,
            }
            rows.append(row)
            print(f"turns {p.name}: turn {k} (+{len(add)} -> {len(history)}) TTFT {wall:.2f}s, evaluated "
                  f"{row['prompt_n']}, cold {len(add)} tokens {alone:.2f}s, ratio "
                  f"{row['ratio_to_new']:.2f}", flush=True)
    return rows


def turns_pd(a: EngineProcess, b: EngineProcess, prefix_n: int, n_turns: int) -> list[dict[str, Any]]:
    """The same session through a P/D hand-off, as vllm-router runs one (``kv_transfer_params``):
    each turn is exported by ``a`` (its slot keeps the history, so a later turn evaluates its
    new tokens) and decoded by ``b``, which pulls the KV; TTFT is from the export request's
    start to ``b``'s first streamed token."""
    prefix = tokens(a.url, prefix_n, seed=77)
    adds = [body_tokens(a.url, 200 + (137 * k) % 301, seed=500 + k) for k in range(n_turns)]
    export = {"do_remote_decode": True, "do_remote_prefill": False}

    def one(history: list[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = httpx.post(a.url + "/v1/completions", json={"prompt": history, "max_tokens": 1, "temperature": 0,
                                                       "kv_transfer_params": export}, timeout=1800)
        r.raise_for_status()
        t_export = time.perf_counter() - t0
        body = r.json()
        first = None
        with httpx.stream(
            "POST",
            b.url + "/v1/completions",
            timeout=1800,
            json={
                "prompt": history,
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "kv_transfer_params": body["kv_transfer_params"],
            },
        ) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
        assert first is not None
        return {"n_prompt": len(history), "ttft_s": first - t0, "export_s": t_export,
                "prompt_n": (body.get("timings") or {}).get("prompt_n"),
                "kv_mib": body["kv_transfer_params"].get("hydra", {}).get("kv_bytes", 0) / 2**20}

    rows = []
    history = list(prefix)
    row = {"turn": 0, **one(history)}
    rows.append(row)
    print(f"turns-pd: turn 0 ({len(history)} tokens) TTFT {row['ttft_s']:.2f}s (export {row['export_s']:.2f}s, KV "
          f"{row['kv_mib']:.1f} MiB)", flush=True)
    for k, add in enumerate(adds, start=1):
        history += add
        row = one(history)
        alone, _ = Peer("hydra-trio", a.url, a.pid, {}).complete(tokens(a.url, len(add), seed=900 + k), cache=False)
        row = {"turn": k, "n_new": len(add), **row, "cold_new_s": alone, "ratio_to_new": row["ttft_s"] / alone}
        rows.append(row)
        print(f"turns-pd: turn {k} (+{len(add)} -> {len(history)}) TTFT {row['ttft_s']:.2f}s (export "
              f"{row['export_s']:.2f}s, "
              f"evaluated {row['prompt_n']}, KV {row['kv_mib']:.1f} MiB), cold {len(add)} tokens {alone:.2f}s, "
              f"ratio {row['ratio_to_new']:.2f}", flush=True)
    return rows


def itl_beside(peer: Peer, stream_prompt: list[int], long_prompt: list[int]) -> dict[str, Any]:
    """The stream's chunk gaps while ``long_prompt`` prefills in the other slot."""
    arrivals: list[float] = []
    started, stop = threading.Event(), threading.Event()
    window: dict[str, float] = {}

    def stream() -> None:
        body = {
            "prompt": stream_prompt,
            "max_tokens": 20000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            **peer.extra,
        }
        with httpx.Client(timeout=1800) as c, c.stream("POST", peer.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 8:
                        started.set()
                    if stop.is_set():
                        return  # closing the connection cancels the stream on both engines

    th = threading.Thread(target=stream, daemon=True)
    th.start()
    if not started.wait(300):
        raise RuntimeError(f"{peer.name}: the stream did not start")
    window["start"] = time.perf_counter()
    wall, t = peer.complete(long_prompt, cache=False)
    window["end"] = time.perf_counter()
    stop.set()
    th.join(60)
    inside = [b - a for a, b in pairwise(arrivals) if b > window["start"] and a < window["end"]]
    before = [b - a for a, b in pairwise(arrivals[:8])]
    return {
        "prefill_wall_s": wall, "prompt_ms": t.get("prompt_ms"), "gaps": len(inside),
        "itl_p50_ms": percentile(inside, 50) * 1e3, "itl_p99_ms": percentile(inside, 99) * 1e3,
        "itl_max_ms": max(inside) * 1e3 if inside else float("nan"),
        "itl_alone_ms": statistics.median(before) * 1e3 if before else float("nan"),
    }


def _chunking(peer: Peer) -> dict[str, float]:
    """The ITL target hydra-trio sized the prompt's parts for, and its part floor, as its
    /metrics says after the run (absent ones left out)."""
    from hydra_trio.testing.metrics_reader import metric_samples

    samples = metric_samples(httpx.get(peer.url + "/metrics", timeout=30).text)
    out = {}
    if (target := samples.get(("hydra_itl_target_seconds", ()))) is not None:
        out["itl_target_ms"] = target * 1e3
    if (floor := samples.get(("hydra_prompt_part_floor_tokens", ()))) is not None:
        out["part_floor_tokens"] = floor
    return out


def itl(peers: list[Peer], n: int, rounds: int, tok_url: str) -> list[dict[str, Any]]:
    rows = []
    for r in range(rounds):
        order = peers if r % 2 == 0 else peers[::-1]
        long_prompt = tokens(tok_url, n, seed=3000 + r)
        alone_prompt = tokens(tok_url, n, seed=3500 + r)  # as long, new to both: the TTFT alone
        stream_prompt = tokens(tok_url, 32, seed=4000 + r)
        for p in order:
            alone_s, _ = p.complete(alone_prompt, cache=False)
            row = {
                "peer": p.name,
                "round": r,
                "n": n,
                "alone_wall_s": alone_s,
                **itl_beside(p, stream_prompt, long_prompt),
            }
            row["beside_over_alone"] = row["prefill_wall_s"] / alone_s
            if p.name == "hydra-trio":
                row.update(_chunking(p))
            rows.append(row)
            print(f"itl {p.name} round {r}: {n}-token prefill beside a stream {row['prefill_wall_s']:.2f}s "
                  f"(alone {alone_s:.2f}s: {row['beside_over_alone']:.2f}x); stream ITL "
                  f"p50 {row['itl_p50_ms']:.0f} ms p99 {row['itl_p99_ms']:.0f} ms max {row['itl_max_ms']:.0f} ms "
                  f"({row['gaps']} gaps; alone {row['itl_alone_ms']:.0f} ms)"
                  + (f"; ITL target {row['itl_target_ms']:.0f} ms, parts >= {row['part_floor_tokens']:.0f} tokens"
                     if "itl_target_ms" in row else ""), flush=True)
        by = {row["peer"]: row for row in rows if row["round"] == r}
        if "hydra-trio" in by and "llama-server" in by:
            print(f"itl round {r}: hydra-trio beside / llama-server beside "
                  f"{by['hydra-trio']['prefill_wall_s'] / by['llama-server']['prefill_wall_s']:.2f}x", flush=True)
    return rows


def _fmt(row: dict[str, Any], peers: list[Peer]) -> str:
    parts = [f"n={row['n']} round {row['round']}:"]
    for p in peers:
        v = row[p.name]
        parts.append(f"{p.name} {v['wall_s']:.2f}s (cpu {v['cpu_s']:.2f}s, prompt_ms {v['prompt_ms'] or 0:.0f})")
    if "ratio" in row:
        parts.append(f"ratio wall {row['ratio']:.3f} cpu {row['cpu_ratio']:.3f}")
    return " ".join(parts)


def ratios(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    out: dict[int, list[float]] = {}
    for row in rows:
        if key in row:
            out.setdefault(row["n"], []).append(row[key])
    return {n: statistics.median(v) for n, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1k and 4k prompts, a 4k session "
                    "prefix, ITL beside 4k, 2 rounds")
    ap.add_argument("--sizes", default=None, help="comma list of cold prompt sizes (default 1024,4096,16384,30720)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per size (default 3; --quick 2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--turns", type=int, default=3, help="later turns of the session")
    ap.add_argument("--prefix", type=int, default=None, help="session prefix tokens (16384; --quick 4096)")
    ap.add_argument("--itl-size", type=int, default=None, help="prompt beside the stream (16384; --quick 4096)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: cold, turns, itl, turns-pd")
    ap.add_argument("--no-llama-server", action="store_true", help="hydra-trio alone")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: the cached build)")
    ap.add_argument("--extra", default="", help="extra hydra-trio serve flags, space separated")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill.json")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in (args.sizes or ("1024,4096" if args.quick else "1024,4096,16384,30720")).split(",")]
    rounds = args.rounds or (2 if args.quick else 3)
    prefix_n = args.prefix or (4096 if args.quick else 16384)
    itl_n = args.itl_size or (4096 if args.quick else 16384)
    skip = set(filter(None, args.skip.split(",")))
    from hydra_trio.model.registry import named_model_path

    model = str(named_model_path("gemma3-270m"))
    n_slot = max([*sizes, prefix_n + 600 * args.turns, itl_n]) + 2048
    binary = None if args.no_llama_server else find_or_build(args.llama_server, build=False)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-prefill-"))
    print(f"logs in {log_dir}; {args.threads} llama thread(s), 2 slots of {n_slot} cells", flush=True)
    hydra = EngineProcess(model, slots=2, ctx_size=2 * n_slot, threads=args.threads, extra=args.extra.split())
    hydra.start(log_dir, "hydra-trio")
    server = None
    try:
        peers = [Peer("hydra-trio", hydra.url, hydra.pid, {})]
        if binary is not None:
            server = LlamaServer(
                binary, model, ctx=2 * n_slot, slots=2, log_dir=log_dir, tag="llama-server", threads=args.threads
            )
            peers.append(Peer("llama-server", server.url, server.proc.pid, {}))
        out: dict[str, Any] = {"env": env_info(), "args": {k: str(v) for k, v in vars(args).items()},
                               "loadavg_start": Path("/proc/loadavg").read_text().split()[:3]}
        if "cold" not in skip:
            out["cold"] = cold(peers, sizes, rounds, hydra.url)
            cpu = ratios(out["cold"], "cpu_ratio")
            for n, ratio in ratios(out["cold"], "ratio").items():
                print(f"cold n={n}: median hydra-trio / llama-server: wall {ratio:.3f}, cpu {cpu[n]:.3f}", flush=True)
        if "turns" not in skip:
            out["turns"] = turns(peers, prefix_n, args.turns, hydra.url)
        if "itl" not in skip:
            out["itl"] = itl(peers, itl_n, max(1, rounds - 1), hydra.url)
        if "turns-pd" not in skip:
            decode = EngineProcess(model, slots=2, ctx_size=2 * n_slot, threads=args.threads, extra=args.extra.split())
            decode.start(log_dir, "hydra-trio-decode")
            try:
                out["turns_pd"] = turns_pd(hydra, decode, prefix_n, args.turns)
            finally:
                decode.stop()
        out["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        if server is not None:
            server.stop()
        hydra.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"load average {out['loadavg_start']} -> {out['loadavg_end']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
