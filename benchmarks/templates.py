"""Render parity with llama-server over llama.cpp's template corpus (issue 41).

`python -m benchmarks.templates` takes every template in the llama-cpp-python sdist's
``vendor/llama.cpp/models/templates/`` and four conversations (plain; tools; a tool round
trip; thinking with ``chat_template_kwargs``), renders each through hydra-trio's chat room
(the code ``/apply-template`` runs, on a template given as ``--chat-template-file``) and asks
llama-server built from the same sdist (``--chat-template-file`` on a synthetic model) for its
``/apply-template``; the two prompts are compared byte for byte. One row per template, then
the count ("ok": the same bytes; "ref": both answer 400, the template raising for that
conversation; "DIF": a difference). Then, unless ``--parity-only`` (template_calls.py):
forced tool calls (``tool_choice`` "required", greedy; a named tool, sampled; "required", sampled and streamed) through
each server's ``/v1/chat/completions`` on the synthetic model with that template, whether their
replies come back as ``tool_calls`` whose arguments validate; the reasoning split of a reply
in the template's own think syntax (our parser; llama-server has no endpoint for it); and
``/apply-template`` round trips, per conversation and for a 20-turn agent conversation with
20 tools, both servers side by side. llama-server's answers are cached per template text
and day (a rerun after a change here takes seconds, its times then from the cached run);
``--refresh`` asks it again.

The templates are not ours and are not copied into this repository: without the sdist the
benchmark says so and stops.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import trio

from hydra_trio.engine.chat import Chat, ChatRequestError, resolve_chat_template
from hydra_trio.model.synthetic import write_model

from . import template_calls as tc
from .harness import EngineProcess, free_port, wait_http
from .llama_server import CACHE, cached_binary

VERSION = "0.3.36"
BOS, EOS = "<s>", "<|im_end|>"  # the synthetic model's BOS and EOS (its EOS is the ChatML turn end)

_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"},
                           "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}]
_CALL = {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke"},
    ]},
    "tools": {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ], "tools": _TOOLS},
    "tool_round_trip": {"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"},
        {"role": "assistant", "content": "It is 21 C in Paris."},
        {"role": "user", "content": "Thanks"},
    ], "tools": _TOOLS},
    "thinking": {"messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "And 3+3?"},
    ], "chat_template_kwargs": {"enable_thinking": True}},
}


def corpus_dir() -> Path:
    return CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "models" / "templates"


def _cache_file() -> Path:
    return CACHE / "template-bench-llama-server.json"


def _key(text: str) -> str:
    # Templates that print today's date render differently tomorrow: the day is in the key.
    return hashlib.sha256(text.encode()).hexdigest()[:16] + ":" + date.today().isoformat()


def llama_server_answers(
    binary: Path, model: Path, template: Path, log_dir: Path, *, http: bool, repeats: int
) -> dict[str, Any]:
    """llama-server's ``/apply-template`` for each conversation ({"prompt": ...} or {"error":
    ...}) under "renders"; with ``http``, its forced calls and render times under "http"."""
    port = free_port()
    log = open(log_dir / f"{template.stem}.llama-server.log", "wb")
    proc = subprocess.Popen(
        [str(binary), "-m", str(model), "-c", "16384", "-np", "1", "-t", "1", "--host", "127.0.0.1",
         "--port", str(port), "--no-warmup", "--jinja", "--chat-template-file", str(template)],
        stdout=log, stderr=log,
    )
    out: dict[str, Any] = {"renders": {}}
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=60)
        except (RuntimeError, TimeoutError) as exc:
            out["renders"] = {name: {"error": f"llama-server did not start: {exc}"} for name in CONVERSATIONS}
            return out
        with httpx.Client(timeout=30) as c:
            for name, body in CONVERSATIONS.items():
                r = c.post(f"http://127.0.0.1:{port}/apply-template", json=body)
                out["renders"][name] = {"prompt": r.json()["prompt"]} if r.status_code == 200 else {
                    "error": f"{r.status_code} {r.text[:200]}"}
        if http:
            out["http"] = tc.server_session(f"http://127.0.0.1:{port}", CONVERSATIONS, calls=True, repeats=repeats)
    finally:
        proc.terminate()
        proc.wait()
        log.close()
    return out


def our_answers(model: Path, template: Path, log_dir: Path, repeats: int) -> dict[str, Any]:
    """The same HTTP session against hydra-trio serving the template (one slot)."""
    engine = EngineProcess(str(model), slots=1, ctx_size=16384, threads=1, batch_size=256,
                           extra=["--chat-template-file", str(template)])
    try:
        engine.start(log_dir, template.stem + ".hydra")
    except (RuntimeError, TimeoutError) as exc:
        return {"error": f"engine did not start: {exc}"}
    try:
        return tc.server_session(engine.url, CONVERSATIONS, calls=True, repeats=repeats)
    finally:
        engine.stop()


async def _no_worker(fn: Any) -> str:
    return fn()


def _no_builtin(*_: Any) -> str:
    raise AssertionError("the corpus is Jinja only")


def ours(template: Path) -> tuple[dict[str, Any], str | None, Chat | None]:
    """hydra-trio's render of each conversation, as ``/apply-template`` answers it, the
    start-up note when the template fell back (None when it is served as given), and the
    chat room (None when the engine would not start)."""
    try:
        tpl = resolve_chat_template(name=None, file=str(template), gguf_template=None, builtin_names=())
    except SystemExit as exc:
        return {name: {"error": f"engine start: {exc}"} for name in CONVERSATIONS}, str(exc), None
    chat = Chat(tpl, tool_call_parser="auto", reasoning_format="auto", bos_token=BOS, eos_token=EOS,
                tokenizer_adds_bos=True, run_on_worker=_no_worker, apply_builtin=_no_builtin)
    out: dict[str, Any] = {}
    for name, body in CONVERSATIONS.items():
        try:
            out[name] = {"prompt": trio.run(chat.render, json.loads(json.dumps(body)))}
        except ChatRequestError as exc:
            out[name] = {"error": f"400 {exc}"}
        except Exception as exc:
            out[name] = {"error": f"500 {type(exc).__name__}: {exc}"}
    return out, getattr(tpl, "fallback_reason", None), chat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.templates", description=__doc__.split("\n\n")[0])
    ap.add_argument("--refresh", action="store_true", help="ask llama-server again (ignore its cached answers)")
    ap.add_argument("-k", default="", help="only templates whose file name contains this")
    ap.add_argument("--templates", default="", help="only templates whose file name contains one of these "
                    "(comma-separated)")
    ap.add_argument("--parity-only", action="store_true", help="render parity only: no servers' forced calls or times")
    ap.add_argument("--repeats", type=int, default=5, help="timed /apply-template calls per conversation (the median)")
    ap.add_argument("--diff", action="store_true", help="print a diff of each differing render")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--markdown", type=Path, help="print the table of a saved --json run as Markdown (runs nothing)")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(args.markdown.read_text())))
        return 0
    root = corpus_dir()
    binary = cached_binary(VERSION)
    if not root.is_dir():
        print(f"no template corpus at {root} (the llama-cpp-python {VERSION} sdist): nothing to compare")
        return 0
    wanted = [w for w in args.templates.split(",") if w]
    templates = sorted(p for p in root.glob("*.jinja")
                       if args.k in p.name and (not wanted or any(w in p.name for w in wanted)))
    http = not args.parity_only
    cache_path = _cache_file()
    cache: dict[str, Any] = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    rows = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpl-parity-") as tmp:
        model = write_model(Path(tmp) / "tiny.gguf", "tiny")
        if http:
            print(f"{'template':44} {'renders':15} {'ms':>6}  forced ours/l-s     think  agent20 ms ours/l-s")
        for t in templates:
            text = t.read_text(encoding="utf-8")
            key = _key(text)
            fresh = args.refresh or key not in cache or (
                http and set(cache[key].get("http", {}).get("forced", {})) != set(tc.FORCED))  # asked other cases
            if fresh:
                if not binary.is_file():
                    print(f"no llama-server at {binary} (python -m benchmarks --with-llama-server builds it)")
                    return 1
                cache[key] = llama_server_answers(binary, model, t, Path(tmp), http=http, repeats=args.repeats)
                cache_path.write_text(json.dumps(cache))
            theirs = cache[key]["renders"]
            t0 = time.perf_counter()
            mine, note, chat = ours(t)
            ms = (time.perf_counter() - t0) * 1000
            same = {n: mine[n] == theirs[n] or (_refused(mine[n]) and _refused(theirs[n])) for n in CONVERSATIONS}
            row: dict[str, Any] = {"template": t.stem, "same": same, "ms": round(ms, 1), "fallback": note,
                                   "ours": mine, "llama_server": theirs}
            marks = " ".join(("DIF" if not same[n] else "ok " if "prompt" in mine[n] else "ref") for n in CONVERSATIONS)
            line = f"{t.stem[:44]:44} {marks}  {ms:6.0f}"
            if http:
                renders_reasoning = tc.REASONING in str(theirs.get("thinking", {}).get("prompt", ""))
                row["tool_format"] = chat.caps.tool_format.name if chat is not None else None
                row["reasoning"] = tc.reasoning_split(chat, renders_reasoning) if chat is not None else {
                    "result": "ERR", "why": note}
                row["in_process_ms"] = (
                    tc.in_process_times(chat, CONVERSATIONS, args.repeats) if chat is not None else {}
                )
                row["hydra_http"] = our_answers(model, t, Path(tmp), args.repeats)
                row["llama_server_http"] = cache[key].get("http", {})
                row["llama_server_fresh"] = fresh
                line += "  " + _forced_marks(row["hydra_http"]) + " / " + _forced_marks(row["llama_server_http"])
                line += (
                    f"   {row['reasoning']['result']:5}  {_agent_ms(row['hydra_http'])}/"
                    f"{_agent_ms(row['llama_server_http'])}"
                )
            rows.append(row)
            print(line + (f"  fallback: {note}" if note else ""), flush=True)
            if args.diff:
                for n in CONVERSATIONS:
                    if not same[n]:
                        _print_diff(n, mine[n], theirs[n])
    total = sum(len(r["same"]) for r in rows)
    ok = sum(sum(r["same"].values()) for r in rows)
    whole = sum(all(r["same"].values()) for r in rows)
    print(f"\n{ok} of {total} conversations render identically; {whole} of {len(rows)} templates in all four")
    totals: dict[str, Any] = {"conversations": total, "identical": ok, "templates": len(rows), "all_four": whole}
    if http:
        totals.update(_http_totals(rows))
        for line in _totals_lines(totals):
            print(line)
    totals["wall_s"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        args.json.write_text(json.dumps({"totals": totals, "rows": [_slim(r) for r in rows]}, indent=1))
    return 0


def _slim(row: dict[str, Any]) -> dict[str, Any]:
    """A row as saved: the prompts of conversations that render the same are their length
    (the templates are not ours; the differences are kept whole)."""
    out = dict(row)
    for side in ("ours", "llama_server"):
        out[side] = {
            n: ({"chars": len(r["prompt"])} if row["same"][n] and "prompt" in r else r) for n, r in row[side].items()
        }
    return out


def markdown_table(run: dict[str, Any]) -> str:
    """One row per template of a saved run: render parity, the tool format ``auto`` picked,
    forced calls (required greedy / named sampled: + parsed and valid, x not), the reasoning
    split, and ``/apply-template`` medians."""
    def ms(session: dict[str, Any], name: str) -> str:
        t = session.get("times", {}).get(name, {})
        return f"{t['ms']:.1f}" if "ms" in t else "err"

    def conv_ms(session: dict[str, Any]) -> str:
        vals = [t["ms"] for n, t in session.get("times", {}).items() if n != "agent20" and "ms" in t]
        return f"{statistics.median(vals):.1f}" if vals else "err"

    lines = ["| template | format | plain | tools | round trip | thinking | forced, ours | forced, llama-server "
             "| reasoning split | /apply-template ms, ours / l-s (median of 4 conv.) | agent20 ms, ours / l-s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in run["rows"]:
        marks = [("DIF" if not r["same"][n] else "ref" if "error" in r["ours"][n] else "ok") for n in CONVERSATIONS]
        ours_s, theirs_s = r.get("hydra_http", {}), r.get("llama_server_http", {})
        lines.append(f"| {r['template']} | {r.get('tool_format')} | " + " | ".join(marks)
                     + f" | {_forced_marks(ours_s)} | {_forced_marks(theirs_s)} | "
                     f"{r.get('reasoning', {}).get('result', '')} "
                     f"| {conv_ms(ours_s)} / {conv_ms(theirs_s)} | "
                     f"{ms(ours_s, 'agent20')} / {ms(theirs_s, 'agent20')} |")
    return "\n".join(lines)


def _forced_marks(session: dict[str, Any]) -> str:
    forced = session.get("forced")
    if not forced:
        return "--"
    return "".join("?" if c not in forced else "+" if forced[c]["ok"] else "x" for c in tc.FORCED)


def _agent_ms(session: dict[str, Any]) -> str:
    agent = session.get("times", {}).get("agent20", {})
    return f"{agent['ms']:.1f}" if "ms" in agent else "err"


def _http_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in ("hydra_http", "llama_server_http"):
        forced = [r[side].get("forced", {}) for r in rows]
        out[side] = {
            "forced_ok": {c: sum(bool(f.get(c, {}).get("ok")) for f in forced) for c in tc.FORCED},
            "templates_all_forced_ok": sum(all(f.get(c, {}).get("ok") for c in tc.FORCED) for f in forced),
        }
    reasoning = [r["reasoning"]["result"] for r in rows]
    out["reasoning"] = {k: reasoning.count(k) for k in sorted(set(reasoning))}
    ratios = []
    per_conv = []
    for r in rows:
        a, b = r["hydra_http"].get("times", {}), r["llama_server_http"].get("times", {})
        if "ms" in a.get("agent20", {}) and "ms" in b.get("agent20", {}):
            ratios.append(a["agent20"]["ms"] / b["agent20"]["ms"])
        for n in CONVERSATIONS:
            if "ms" in a.get(n, {}) and "ms" in b.get(n, {}):
                per_conv.append(a[n]["ms"] / b[n]["ms"])
    if ratios:
        out["agent20_ratio"] = {"median": round(statistics.median(ratios), 2), "max": round(max(ratios), 2),
                                "n": len(ratios), "within_2x": sum(x <= 2 for x in ratios)}
    if per_conv:
        out["per_conversation_ratio"] = {
            "median": round(statistics.median(per_conv), 2),
            "max": round(max(per_conv), 2),
            "n": len(per_conv),
        }
    return out


def _totals_lines(t: dict[str, Any]) -> list[str]:
    lines = []
    for side, label in (("hydra_http", "hydra-trio"), ("llama_server_http", "llama-server")):
        f = t[side]["forced_ok"]
        lines.append(f"{label}: forced calls "
                     "parsed and valid: " + ", ".join(f"{c} {n}/{t['templates']}" for c, n in f.items())
                     + f"; all on {t[side]['templates_all_forced_ok']} templates")
    lines.append("reasoning split: " + ", ".join(f"{k} {v}" for k, v in t["reasoning"].items()))
    if "agent20_ratio" in t:
        a = t["agent20_ratio"]
        lines.append(f"20-turn, 20-tool /apply-template, ours / llama-server: median {a['median']}x, max {a['max']}x, "
                     f"within 2x on {a['within_2x']} of {a['n']}")
    if "per_conversation_ratio" in t:
        p = t["per_conversation_ratio"]
        lines.append(f"per-conversation /apply-template, ours / llama-server: median {p['median']}x, max {p['max']}x "
                     f"(n={p['n']})")
    return lines


def _refused(render: dict[str, Any]) -> bool:
    """A 400 (the template raised for this conversation): both refusing is parity, whatever
    the wording."""
    return str(render.get("error", "")).startswith("400")


def _print_diff(name: str, mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    a = mine.get("prompt", "ERROR " + str(mine.get("error")))
    b = theirs.get("prompt", "ERROR " + str(theirs.get("error")))
    print(f"  --- {name}")
    for line in difflib.unified_diff(b.splitlines(), a.splitlines(), "llama-server", "hydra-trio", lineterm="", n=1):
        print("    " + line[:300])


if __name__ == "__main__":
    sys.exit(main())
