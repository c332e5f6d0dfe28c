"""Multi-turn chat against one engine: how much of each later turn's prompt comes from cache.

    python -m benchmarks.sessions [--preset small] [--slots 4] [--sessions 4,16] [--turns 3]
                                  [--with-llama-server | --llama-server PATH]

Each session opens with a 60-word message and adds a 10-word question per turn; the sessions
take turns (session 1's turn 1, session 2's turn 1, ... then every session's turn 2), so with
more sessions than slots every history must survive other sessions in between. The same
requests go to hydra-trio and to llama-server (``-np`` slots, its own ``--cache-ram``
default). Figures, over the later turns (2..N): prompt tokens, the share served from cache
(``usage.prompt_tokens_details.cached_tokens``, or llama-server's ``timings.cache_n``), and the
oracle's share: an engine that holds every history (the previous turn's prompt and answer,
as this turn's tokens see them). With a real model (``--model gemma3-270m``) an answer's text
tokenizes back into the tokens that were generated; the synthetic models' random text often
does not, which no engine can reuse, so their oracle is an upper bound nobody reaches. Goals (issue "Many engines as one
cache", item 0): 4 sessions on 4 slots >= 0.95x the oracle and >= llama-server; 16 sessions on 4 slots >= 0.8x the
oracle and >= llama-server.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from .harness import EngineProcess, env_info, words_prompt
from .llama_server import LlamaServer, find_or_build

RESULTS = Path(__file__).resolve().parent / "results"


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokens_of(c: httpx.Client, text: str) -> list[int]:
    r = c.post("/tokenize", json={"content": text, "add_special": True, "parse_special": True})
    r.raise_for_status()
    return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]


def rendered(c: httpx.Client, messages: list[dict[str, str]]) -> str:
    r = c.post("/apply-template", json={"messages": messages})
    r.raise_for_status()
    return r.json()["prompt"]


def run(url: str, n_sessions: int, turns: int, n_predict: int, tokenizer: httpx.Client) -> dict[str, Any]:
    convs = [
        [{"role": "user", "content": f"session {i}: " + words_prompt(60, seed=7000 + i)}] for i in range(n_sessions)
    ]
    last_full: list[list[int]] = [[] for _ in range(n_sessions)]  # previous prompt + answer, as tokens
    rows = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for turn in range(turns):
            for i, conv in enumerate(convs):
                r = c.post(
                    "/v1/chat/completions",
                    json={"messages": conv, "max_tokens": n_predict, "temperature": 0, "cache_prompt": True},
                )
                r.raise_for_status()
                body = r.json()
                answer = body["choices"][0]["message"]["content"]
                prompt_text = rendered(tokenizer, conv)
                prompt_tokens = tokens_of(tokenizer, prompt_text)
                usage = body.get("usage", {})
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if cached is None:  # llama-server without the OpenAI detail
                    cached = body.get("timings", {}).get("cache_n", 0)
                oracle = common_prefix_len(last_full[i], prompt_tokens)
                rows.append(
                    {"session": i, "turn": turn, "prompt_tokens": usage.get("prompt_tokens", len(prompt_tokens)),
                     "cached": cached, "oracle": oracle}
                )
                last_full[i] = tokens_of(tokenizer, prompt_text + answer)
                conv += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": words_prompt(10, seed=9000 + 100 * i + turn) + "?"},
                ]
    later = [r for r in rows if r["turn"] > 0]
    total = sum(r["prompt_tokens"] for r in later)
    return {
        "sessions": n_sessions,
        "later_prompt_tokens": total,
        "later_cached": sum(r["cached"] for r in later),
        "later_oracle": sum(r["oracle"] for r in later),
        "cached_share": sum(r["cached"] for r in later) / total,
        "oracle_share": sum(r["oracle"] for r in later) / total,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sessions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="synthetic model preset (ignored with --model)")
    ap.add_argument("--model", default=None, help="a GGUF path or a named model (gemma3-270m)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--slot-ctx", type=int, default=2048)
    ap.add_argument("--sessions", default="4,16")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=24)
    ap.add_argument("--extra", default="", help="more hydra-trio serve flags")
    ap.add_argument("--with-llama-server", action="store_true")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--out", default=str(RESULTS / "sessions.json"))
    args = ap.parse_args(argv)
    from hydra_trio.model.synthetic import write_model

    work = Path(tempfile.mkdtemp(prefix="hydra-sessions-"))
    if args.model:
        from hydra_trio.model.registry import named_model_path

        model = Path(args.model) if Path(args.model).is_file() else named_model_path(args.model)
    else:
        model = work / f"{args.preset}.gguf"
        write_model(model, args.preset, seed=0)
    ctx = args.slots * args.slot_ctx
    binary = find_or_build(args.llama_server, args.with_llama_server)
    results: dict[str, Any] = {"env": env_info(), "args": vars(args), "runs": []}
    lines = [
        "| sessions on slots | oracle share | hydra-trio share (× oracle) | llama-server share (× oracle) |",
        "|---|---|---|---|",
    ]
    for n in (int(x) for x in args.sessions.split(",")):
        # Fresh servers per workload: nothing cached from the previous one.
        ours = EngineProcess(str(model), slots=args.slots, ctx_size=ctx, threads=2, extra=args.extra.split())
        ours.start(work, f"hydra-trio-{n}")
        try:
            with httpx.Client(base_url=ours.url, timeout=60) as tok:
                mine = run(ours.url, n, args.turns, args.n_predict, tok)
                peer = None
                if binary is not None:
                    with LlamaServer(
                        binary, str(model), ctx=ctx, slots=args.slots, log_dir=work, tag=f"llama-server-{n}"
                    ) as ls:
                        peer = run(ls.url, n, args.turns, args.n_predict, tok)
        finally:
            ours.stop()
        results["runs"].append({"sessions": n, "hydra-trio": mine, "llama-server": peer})
        o = mine["oracle_share"]
        peer_cell = f"{peer['cached_share']:.1%} ({peer['cached_share'] / peer['oracle_share']:.2f}×)" if peer else "–"
        lines.append(f"| {n} on {args.slots} | {o:.1%} | {mine['cached_share']:.1%} ({mine['cached_share'] / o:.2f}×) "
                     f"| {peer_cell} |")
        print(lines[-1], flush=True)
    results["table"] = "\n".join(lines)
    print(results["table"])
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
