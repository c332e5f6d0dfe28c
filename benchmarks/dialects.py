"""The agents' dialects against chat completions and against llama-server (issue 40, item 7).

    python -m benchmarks.dialects [--streams 1,8] [--rounds 3] [--tokens 96] [--turns 4]
                                  [--threads 1] [--llama-server PATH | --no-llama-server]

Real model (Gemma 3 270M) with the corpus's Gemma template (``google-gemma-2-2b-it.jinja``,
the same turn markup as Gemma 3's) given to both servers with ``--chat-template-file``, so
both render the same prompt. Each round sends, per server (their order alternating) and per
dialect (``/v1/chat/completions``, ``/v1/messages``, ``/v1/responses``), N concurrent
streamed greedy requests with new prompts; every round is printed.

- streams: aggregate tok/s, the output tokens every stream's usage reports over the time
  from the first text event of any stream to the last event of all; each dialect's ratio to
  chat completions on the same server, and each server's against the other's.
- sessions: a multi-turn agent-like conversation per dialect (a long system prompt, then
  turns each adding a question and the previous answer), unstreamed: the share of the later
  turns' prompt tokens served from cache, as each dialect's usage reports it (chat:
  ``prompt_tokens_details.cached_tokens``; messages: ``cache_read_input_tokens``; responses:
  ``input_tokens_details.cached_tokens``); "n/a" where a server's reply does not say.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from .harness import EngineProcess, env_info, words_prompt
from .llama_server import LlamaServer, find_or_build, sdist_tree

RESULTS = Path(__file__).resolve().parent / "results"
DIALECTS = ("chat", "messages", "responses")
SYSTEM = "You are a helpful assistant. Answer briefly."


def request(dialect: str, system: str, turns: list[tuple[str, str]], question: str, max_tokens: int,
            stream: bool) -> tuple[str, dict[str, Any]]:
    """The route and body of one request in ``dialect``: the system prompt, earlier
    (question, answer) turns, then ``question``."""
    if dialect == "chat":
        messages = [{"role": "system", "content": system}]
        for q, a in turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": question})
        body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", {**body, "temperature": 0, "stream": stream}
    if dialect == "messages":
        msgs = []
        for q, a in turns:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": question})
        return "/v1/messages", {"model": "local", "system": system, "messages": msgs, "max_tokens": max_tokens,
                                "temperature": 0, "stream": stream}
    items: list[dict[str, Any]] = []
    for q, a in turns:
        items += [{"type": "message", "role": "user", "content": q},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": a}]}]
    items.append({"type": "message", "role": "user", "content": question})
    return "/v1/responses", {"model": "local", "instructions": system, "input": items, "max_output_tokens": max_tokens,
                             "temperature": 0, "stream": stream, "store": False}


def event_text(dialect: str, event: dict[str, Any]) -> str:
    """The reply text a streamed event carries ("" for the others)."""
    if dialect == "chat":
        choices = event.get("choices") or [{}]
        return (choices[0].get("delta") or {}).get("content") or ""
    if dialect == "messages":
        delta = event.get("delta") or {}
        return delta.get("text") or "" if event.get("type") == "content_block_delta" else ""
    return event.get("delta") or "" if event.get("type") == "response.output_text.delta" else ""


def output_tokens(dialect: str, events: list[dict[str, Any]]) -> int:
    """Output tokens as the stream's own usage reports them."""
    for event in reversed(events):
        if dialect == "chat" and event.get("usage"):
            return int(event["usage"]["completion_tokens"])
        if dialect == "messages" and event.get("type") == "message_delta":
            return int(event["usage"]["output_tokens"])
        if dialect == "responses" and event.get("type") in ("response.completed", "response.incomplete"):
            return int(event["response"]["usage"]["output_tokens"])
    raise RuntimeError(f"{dialect}: the stream reported no usage")


def one_stream(url: str, dialect: str, question: str, max_tokens: int) -> dict[str, Any]:
    route, body = request(dialect, SYSTEM, [], question, max_tokens, stream=True)
    events: list[dict[str, Any]] = []
    first = None
    with (
        httpx.Client(timeout=600) as c,
        c.stream(
            "POST", url + route, json=body, headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"}
        ) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            events.append(event)
            if first is None and event_text(dialect, event):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{dialect}: no text event")
    return {"first": first, "last": time.perf_counter(), "tokens": output_tokens(dialect, events)}


def streams(url: str, dialect: str, n: int, seed: int, max_tokens: int) -> dict[str, Any]:
    results: list[dict[str, Any] | BaseException] = [RuntimeError("not run")] * n

    def run(i: int) -> None:
        try:
            results[i] = one_stream(url, dialect, words_prompt(48, seed=seed + i) + "\nContinue the story:", max_tokens)
        except BaseException as e:  # reported below, with the stream's index
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    for i, res in enumerate(results):
        if isinstance(res, BaseException):
            raise RuntimeError(f"{dialect} stream {i}: {res!r}") from res
    done = [r for r in results if isinstance(r, dict)]
    span = max(r["last"] for r in done) - min(r["first"] for r in done)
    tokens = sum(r["tokens"] for r in done)
    return {"tokens": tokens, "span_s": span, "tok_s": tokens / span}


def reply_of(dialect: str, body: dict[str, Any]) -> tuple[str, int | None, int | None]:
    """An unstreamed reply's text, prompt tokens and cached prompt tokens (None: not said)."""
    if dialect == "chat":
        usage = body["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None and "timings" in body:
            cached = body["timings"].get("cache_n")
        return body["choices"][0]["message"]["content"] or "", usage["prompt_tokens"], cached
    if dialect == "messages":
        usage = body["usage"]
        text = "".join(b.get("text", "") for b in body["content"] if b.get("type") == "text")
        cached = usage.get("cache_read_input_tokens")
        return text, usage["input_tokens"] + (cached or 0), cached
    usage = body["usage"]
    text = "".join(part.get("text", "") for item in body["output"] if item.get("type") == "message"
                   for part in item.get("content", []))
    return text, usage["input_tokens"], (usage.get("input_tokens_details") or {}).get("cached_tokens")


def session(url: str, dialect: str, n_turns: int, max_tokens: int) -> dict[str, Any]:
    system = SYSTEM + "\n" + words_prompt(1200, seed=11)  # an agent's long instructions
    turns: list[tuple[str, str]] = []
    rows = []
    for k in range(n_turns):
        question = words_prompt(30, seed=200 + k) + "?"
        route, body = request(dialect, system, turns, question, max_tokens, stream=False)
        r = httpx.post(
            url + route, json=body, timeout=600, headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"}
        )
        r.raise_for_status()
        text, prompt, cached = reply_of(dialect, r.json())
        rows.append({"turn": k, "prompt_tokens": prompt, "cached_tokens": cached})
        turns.append((question, text))
    later = rows[1:]
    share = None
    if later and all(row["cached_tokens"] is not None for row in later):
        share = sum(row["cached_tokens"] for row in later) / sum(row["prompt_tokens"] for row in later)
    return {"turns": rows, "cached_share": share}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dialects", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,8", help="comma list of concurrent stream counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96, help="max output tokens a stream")
    ap.add_argument("--turns", type=int, default=4, help="turns of each dialect's session")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: the cached build)")
    ap.add_argument("--out", type=Path, default=RESULTS / "dialects.json")
    args = ap.parse_args(argv)
    counts = [int(s) for s in args.streams.split(",")]
    from importlib.metadata import version

    from hydra_trio.model.registry import named_model_path

    model = str(named_model_path("gemma3-270m"))
    template = sdist_tree(version("llama-cpp-python")) / "vendor/llama.cpp/models/templates/google-gemma-2-2b-it.jinja"
    slots, per_slot = max(counts), 4096
    binary = None if args.no_llama_server else find_or_build(args.llama_server, build=False)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-dialects-"))
    print(f"logs in {log_dir}; template {template.name}; {slots} "
          f"slots of {per_slot} cells, {args.threads} thread(s)", flush=True)
    hydra = EngineProcess(model, slots=slots, ctx_size=slots * per_slot, threads=args.threads,
                          extra=["--chat-template-file", str(template)]).start(log_dir, "hydra-trio")
    server = None
    try:
        servers = {"hydra-trio": hydra.url}
        if binary is not None:
            server = LlamaServer(binary, model, ctx=slots * per_slot, slots=slots, log_dir=log_dir, tag="llama-server",
                                 threads=args.threads, extra=["--jinja", "--chat-template-file", str(template)])
            servers["llama-server"] = server.url
        rows = []
        for r in range(args.rounds):
            order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
            for n in counts:
                for name, url in order:
                    for d in DIALECTS:
                        res = streams(url, d, n, seed=10_000 * r + 100 * n, max_tokens=args.tokens)
                        rows.append({"round": r, "server": name, "dialect": d, "streams": n, **res})
                        print(f"round {r} {name} {d} x{n}: {res['tok_s']:.1f} "
                              f"tok/s ({res['tokens']} tokens)", flush=True)
        sessions = {name: {d: session(url, d, args.turns, 32) for d in DIALECTS} for name, url in servers.items()}
    finally:
        if server is not None:
            server.stop()
        hydra.stop()

    def med(name: str, d: str, n: int) -> float:
        return statistics.median(x["tok_s"] for x in rows if (x["server"], x["dialect"], x["streams"]) == (name, d, n))

    summary = []
    for n in counts:
        for name in servers:
            for d in DIALECTS:
                line = {"server": name, "dialect": d, "streams": n, "tok_s": med(name, d, n),
                        "vs_chat": med(name, d, n) / med(name, "chat", n)}
                if name == "hydra-trio" and "llama-server" in servers:
                    line["vs_llama_server"] = med(name, d, n) / med("llama-server", d, n)
                summary.append(line)
                extra = f", {line['vs_llama_server']:.3f}x llama-server" if "vs_llama_server" in line else ""
                print(f"median {name} {d} x{n}: {line['tok_s']:.1f} tok/s, {line['vs_chat']:.3f}x chat{extra}")
    for name, by_dialect in sessions.items():
        for d, s in by_dialect.items():
            share = "n/a" if s["cached_share"] is None else f"{100 * s['cached_share']:.1f} %"
            print(f"session {name} {d}: later turns' prompt served from cache {share} "
                  f"(prompt tokens {[t['prompt_tokens'] for t in s['turns']]}, cached "
                  f"{[t['cached_tokens'] for t in s['turns']]})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env_info(), "args": {k: str(v) for k, v in vars(args).items()},
                                    "rows": rows, "summary": summary, "sessions": sessions}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
