"""`python -m benchmarks.agent_tools [--model synthetic|gemma3-270m|PATH] [--ctx-size N]
[--rounds 3] [--json PATH]`: first-token latency with Claude Code's full tool list (issue 49,
item 7).

The tool list is the one Claude Code sent with tool search off, recorded from the client
(tests/corpus/claude-code-tools.json: 21 tools, ``SendMessage``'s ``allOf`` of patterns
included; re-recorded with the corpus, tests/corpus/README.md). The engine runs in its own
process; each case is a streamed request over loopback HTTP, timed to its first token event
(a content or tool-call delta): "cold" is the case's first request (its grammar compiled, its
prompt computed), "warm" the median of the next ones, each with a different last message (the
grammar cache and the prefix cache warm).

Cases: ``/v1/messages`` with the tools as Claude Code sends them (no ``tool_choice``: auto,
a lazy grammar) and with ``{"type": "any"}``; ``/v1/chat/completions`` with the same tools in
OpenAI's shape, ``auto`` and ``required``; and the same chat request with ``tool_choice:
"none"`` and with no tools at all, the baselines: (required - none) is what the constraint
adds to the first token, (none - no tools) what the tools' text adds to the prompt. A refusal
is printed with its message (main, when recorded: 400 for ``allOf`` on a string).
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

from .harness import EngineProcess

TOOLS_FILE = Path(__file__).resolve().parent.parent / "tests" / "corpus" / "claude-code-tools.json"


def anthropic_tools() -> list[dict[str, Any]]:
    return json.loads(TOOLS_FILE.read_text())["tools"]


def openai_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t["input_schema"]}} for t in anthropic_tools()]


def cases() -> dict[str, tuple[str, dict[str, Any]]]:
    messages, chat = anthropic_tools(), openai_tools()
    return {
        "messages, 21 tools (auto)": ("/v1/messages", {"tools": messages}),
        "messages, 21 tools (any)": ("/v1/messages", {"tools": messages, "tool_choice": {"type": "any"}}),
        "chat, 21 tools (auto)": ("/v1/chat/completions", {"tools": chat, "tool_choice": "auto"}),
        "chat, 21 tools (required)": ("/v1/chat/completions", {"tools": chat, "tool_choice": "required"}),
        "chat, 21 tools (none)": ("/v1/chat/completions", {"tools": chat, "tool_choice": "none"}),
        "chat, no tools": ("/v1/chat/completions", {}),
    }


def first_token_ms(client: httpx.Client, path: str, extra: dict[str, Any], text: str) -> tuple[float | None, str]:
    """(ms to the first token event, "" or the refusal)."""
    body = {"model": "bench", "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": text}], **extra}
    t0 = time.perf_counter()
    with client.stream("POST", path, json=body, headers={"anthropic-version": "2023-06-01"}) as r:
        if r.status_code != 200:
            r.read()
            return None, f"{r.status_code}: {r.text[:200]}"
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and _carries_a_token(line[5:].strip()):
                first = (time.perf_counter() - t0) * 1000.0
    return first, "" if first is not None else "no token event"


def _carries_a_token(data: str) -> bool:
    if data == "[DONE]":
        return False
    event = json.loads(data)
    if event.get("type") == "content_block_delta":
        return True
    delta = ((event.get("choices") or [{}])[0]).get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))


def resolve_model(name: str) -> str:
    if name == "synthetic":
        from hydra_trio.model.synthetic import write_model

        path = Path(tempfile.gettempdir()) / "hydra-bench-small.gguf"
        if not path.exists():
            write_model(path, "small", seed=0)
        return str(path)
    if name.endswith(".gguf"):
        return name
    from hydra_trio.model.registry import named_model_path

    return str(named_model_path(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic", help="synthetic (the small preset), "
                    "a registry name, or a .gguf path")
    ap.add_argument("--ctx-size", type=int, default=65536, help="Claude Code's tools alone are ~40k characters")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as logs:
        engine = EngineProcess(resolve_model(args.model), slots=1, ctx_size=args.ctx_size, threads=args.threads)
        engine.start(Path(logs), "agent_tools")
        try:
            with httpx.Client(base_url=engine.url, timeout=600) as client:
                for rnd in range(args.rounds):
                    for name, (path, extra) in cases().items():
                        row = results.setdefault(name, {"cold": [], "warm": [], "refused": ""})
                        for n in range(2):
                            ms, refused = first_token_ms(client, path, extra, f"round {rnd}.{n}: list the files")
                            if ms is not None:
                                row["warm" if row["cold"] else "cold"].append(ms)
                            row["refused"] = row["refused"] or refused
        finally:
            engine.stop()
    print(f"{'case':32} {'cold ms':>10} {'warm ms (median)':>17}  refused")
    for name, row in results.items():
        med = {k: f"{statistics.median(row[k]):.1f}" if row[k] else "-" for k in ("cold", "warm")}
        print(f"{name:32} {med['cold']:>10} {med['warm']:>17}  {row['refused']}")
    if args.json:
        versions = json.loads(TOOLS_FILE.read_text())["versions"]
        args.json.write_text(json.dumps({"model": args.model, "tools": versions, "cases": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
