"""Render parity with llama-server over llama.cpp's template corpus (issue 41).

`python -m benchmarks.templates` takes every template in the llama-cpp-python sdist's
``vendor/llama.cpp/models/templates/`` and four conversations (plain; tools; a tool round
trip; thinking with ``chat_template_kwargs``), renders each through hydra-trio's chat room
(the code ``/apply-template`` runs, on a template given as ``--chat-template-file``) and asks
llama-server built from the same sdist (``--chat-template-file`` on a synthetic model) for its
``/apply-template``; the two prompts are compared byte for byte. One row per template, then
the count ("ok": the same bytes; "ref": both answer 400, the template raising for that
conversation; "DIF": a difference). llama-server's answers are cached per template text and day (a rerun after a
change here takes seconds); ``--refresh`` asks it again.

The templates are not ours and are not copied into this repository: without the sdist the
benchmark says so and stops.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
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

from .harness import free_port, wait_http
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
    return CACHE / "template-parity-llama-server.json"


def _key(text: str) -> str:
    # Templates that print today's date render differently tomorrow: the day is in the key.
    return hashlib.sha256(text.encode()).hexdigest()[:16] + ":" + date.today().isoformat()


def llama_server_renders(binary: Path, model: Path, template: Path, log_dir: Path) -> dict[str, Any]:
    """llama-server's ``/apply-template`` for each conversation: {"prompt": ...} or {"error": ...}."""
    port = free_port()
    log = open(log_dir / f"{template.stem}.log", "wb")
    proc = subprocess.Popen(
        [str(binary), "-m", str(model), "-c", "2048", "-np", "1", "-t", "1", "--host", "127.0.0.1",
         "--port", str(port), "--no-warmup", "--jinja", "--chat-template-file", str(template)],
        stdout=log, stderr=log,
    )
    out: dict[str, Any] = {}
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=60)
        except (RuntimeError, TimeoutError) as exc:
            return {name: {"error": f"llama-server did not start: {exc}"} for name in CONVERSATIONS}
        with httpx.Client(timeout=30) as c:
            for name, body in CONVERSATIONS.items():
                r = c.post(f"http://127.0.0.1:{port}/apply-template", json=body)
                out[name] = {"prompt": r.json()["prompt"]} if r.status_code == 200 else {
                    "error": f"{r.status_code} {r.text[:200]}"}
    finally:
        proc.terminate()
        proc.wait()
        log.close()
    return out


async def _no_worker(fn: Any) -> str:
    return fn()


def _no_builtin(*_: Any) -> str:
    raise AssertionError("the corpus is Jinja only")


def ours(template: Path) -> tuple[dict[str, Any], str | None]:
    """hydra-trio's render of each conversation, as ``/apply-template`` answers it, and the
    start-up note when the template fell back (None when it is served as given)."""
    try:
        tpl = resolve_chat_template(name=None, file=str(template), gguf_template=None, builtin_names=())
    except SystemExit as exc:
        return {name: {"error": f"engine start: {exc}"} for name in CONVERSATIONS}, str(exc)
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
    return out, getattr(tpl, "fallback_reason", None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.templates", description=__doc__.split("\n\n")[0])
    ap.add_argument("--refresh", action="store_true", help="ask llama-server again (ignore its cached answers)")
    ap.add_argument("-k", default="", help="only templates whose file name contains this")
    ap.add_argument("--diff", action="store_true", help="print a diff of each differing render")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    root = corpus_dir()
    binary = cached_binary(VERSION)
    if not root.is_dir():
        print(f"no template corpus at {root} (the llama-cpp-python {VERSION} sdist): nothing to compare")
        return 0
    templates = sorted(p for p in root.glob("*.jinja") if args.k in p.name)
    cache_path = _cache_file()
    cache: dict[str, Any] = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpl-parity-") as tmp:
        model = write_model(Path(tmp) / "tiny.gguf", "tiny")
        for t in templates:
            text = t.read_text(encoding="utf-8")
            key = _key(text)
            if args.refresh or key not in cache:
                if not binary.is_file():
                    print(f"no llama-server at {binary} (python -m benchmarks --with-llama-server builds it)")
                    return 1
                cache[key] = llama_server_renders(binary, model, t, Path(tmp))
                cache_path.write_text(json.dumps(cache))
            theirs = cache[key]
            t0 = time.perf_counter()
            mine, note = ours(t)
            ms = (time.perf_counter() - t0) * 1000
            same = {n: mine[n] == theirs[n] or (_refused(mine[n]) and _refused(theirs[n])) for n in CONVERSATIONS}
            rows.append({"template": t.stem, "same": same, "ms": round(ms, 1), "fallback": note,
                         "ours": mine, "llama_server": theirs})
            marks = " ".join(("DIF" if not same[n] else "ok " if "prompt" in mine[n] else "ref") for n in CONVERSATIONS)
            print(f"{t.stem[:48]:48} {marks}  {ms:7.1f} ms" + (f"  fallback: {note}" if note else ""))
            if args.diff:
                for n in CONVERSATIONS:
                    if not same[n]:
                        _print_diff(n, mine[n], theirs[n])
    total = sum(len(r["same"]) for r in rows)
    ok = sum(sum(r["same"].values()) for r in rows)
    whole = sum(all(r["same"].values()) for r in rows)
    print(f"\n{ok} of {total} conversations render identically; {whole} of {len(rows)} templates in all four")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


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
