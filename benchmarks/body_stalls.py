"""``python -m benchmarks.body_stalls [--slot-tokens 2048] [--json PATH]``: what one large
request body costs the streams beside it and the engine's memory (issue 50).

A ``hydra-trio serve`` process (tiny synthetic model, 3 slots of ``--slot-tokens`` positions,
so the prompt routes' body cap is what such a slot can use: 1.2 MiB at 2,048, 13.6 MB at
131,072) streams two well-formed completions, read in their own process (the hostile
campaign's reader, every token stamped with CLOCK_MONOTONIC), while each hostile body is sent
alone, 0.5 s apart: as many tiny messages as fit the cap, to chat, Anthropic's messages and
count_tokens, and Responses and input_tokens; one long message of text; then six of each
counting route at once. For each: the reply's status and time, the worst gap between two
tokens of a stream that was running while it was in flight, and the engine's RSS growth
(its peak, reset before each, less its RSS before).

Runs against whatever ``hydra_trio`` the interpreter imports (PYTHONPATH), so the same
command measures another checkout side by side; say which machine, and that it was shared."""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from hydra_trio.testing.process import EngineProcess

RESULTS = Path(__file__).resolve().parent / "results"
TINY = {"role": "user", "content": "a"}


def cap_bytes(slot_tokens: int) -> int:
    """The prompt routes' body cap at this slot size (engine/inputs.py max_request_json_bytes)."""
    return 3 * 32 * slot_tokens + (1 << 20)


def tiny_messages(route: str, limit: int, count: int | None = None) -> bytes:
    """As many tiny messages as fit ``limit`` bytes (or ``count``), in the route's shape."""
    item = json.dumps(TINY, separators=(",", ":")).encode()
    n = min((limit - 200) // (len(item) + 1), count or limit)
    items = b"[" + b",".join([item] * n) + b"]"
    if route.startswith("/v1/responses"):
        head = b'{"max_output_tokens":1,"input":' if route == "/v1/responses" else b'{"input":'
    else:
        head = b'{"max_tokens":1,"messages":' if route != "/v1/messages/count_tokens" else b'{"messages":'
    return head + items + b"}"


def long_text(route: str, limit: int, unit: str = "word ") -> bytes:
    """One message of text: ``unit`` again and again, as much as fits ``limit``."""
    text = unit * ((limit - 200) // len(unit))
    if route.startswith("/v1/responses"):
        return json.dumps({"input": text, **({"max_output_tokens": 1} if route == "/v1/responses" else {})}).encode()
    return json.dumps(
        {"messages": [{"role": "user", "content": text}], **({"max_tokens": 1} if "count" not in route else {})}
    ).encode()


ROUTES = (
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/responses/input_tokens",
)


async def send(c: httpx.AsyncClient, path: str, body: bytes) -> tuple[int, float]:
    t0 = time.monotonic()
    r = await c.post(path, content=body, headers={"content-type": "application/json"})
    return r.status_code, time.monotonic() - t0


async def drive(engine: EngineProcess, slot_tokens: int, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    cap = cap_bytes(slot_tokens)
    cases: list[tuple[str, str, bytes, int]] = []
    for route in ROUTES:
        cases.append((f"{route} tiny messages", route, tiny_messages(route, cap), 1))
    for route in ("/v1/chat/completions", "/v1/messages"):  # as many turns as a slot has positions, less one
        cases.append((f"{route} {slot_tokens - 1} tiny messages", route, tiny_messages(route, cap, slot_tokens - 1), 1))
    text_cap = 32 * slot_tokens  # engine/inputs.py MAX_PROMPT_BYTES_PER_POSITION: text past it is refused untokenized
    for route in ("/v1/chat/completions", "/v1/messages/count_tokens"):
        cases.append((f"{route} one long message", route, long_text(route, cap), 1))
        cases.append((f"{route} special "
                      "tokens in one message", route, long_text(route, text_cap - 4096, "<|im_end|>a"), 1))
    for route in ("/v1/messages/count_tokens", "/v1/responses/input_tokens"):
        cases.append((f"{route} tiny messages x6 at once", route, tiny_messages(route, cap), 6))
    cases = [case for case in cases if not any(s in case[0] for s in skip)]
    out = []
    async with httpx.AsyncClient(base_url=engine.url, timeout=600) as c:
        await trio.sleep(2.0)  # the streams are under way
        for name, path, body, at_once in cases:
            await trio.sleep(0.5)
            rss0 = engine.rss_bytes()
            engine.reset_peak_rss()
            t0 = time.monotonic()
            results: list[tuple[int, float]] = []

            async def one(path: str = path, body: bytes = body, results: list[tuple[int, float]] = results) -> None:
                results.append(await send(c, path, body))

            async with trio.open_nursery() as nursery:
                for _ in range(at_once):
                    nursery.start_soon(one)
            t1 = time.monotonic()
            out.append({
                "case": name, "body_mb": round(len(body) / 1e6, 2), "status": sorted({s for s, _ in results}),
                "ms": [round(s * 1000) for _, s in results], "t0": t0, "t1": t1,
                "rss_growth_mb": round((engine.peak_rss_bytes() - rss0) / 2**20, 1),
            })
            print(out[-1]["case"], out[-1]["status"], out[-1]["ms"], out[-1]["rss_growth_mb"], flush=True)
    return out


def worst_gaps(runs: list[dict[str, Any]], t0: float, t1: float) -> float:
    """The longest wait between two tokens of any stream, where the wait overlaps [t0, t1]."""
    worst = 0.0
    for run in runs:
        stamps = [run["t0"], *run["arrivals"]]
        for a, b in itertools.pairwise(stamps):
            if b >= t0 and a <= t1:
                worst = max(worst, b - a)
    return round(worst * 1000, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.body_stalls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--slot-tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip", action="append", default=[], help="leave out the cases whose name holds this")
    args = ap.parse_args(argv)
    from hydra_trio.model.synthetic import write_model

    with tempfile.TemporaryDirectory(prefix="hydra-stalls-") as tmp:
        log_dir = Path(tmp)
        model = write_model(log_dir / "tiny.gguf", "tiny", seed=0)
        engine = EngineProcess(str(model), slots=3, ctx_size=3 * args.slot_tokens, threads=1, batch_size=64,
                               extra=("--slot-wait-s", "5"))
        engine.start(log_dir, "engine")
        stream_out = log_dir / "streams.json"
        try:
            reader = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hydra_trio.testing.hostile",
                    "--stream-reader",
                    str(engine.http_port),
                    "2",
                    "3600",
                    "1500",
                    "60",
                    str(stream_out),
                ]
            )
            cases = trio.run(drive, engine, args.slot_tokens, tuple(args.skip))
            stream_out.with_suffix(".stop").touch()
            reader.wait(timeout=90)
            rss_end = engine.rss_bytes()
        finally:
            engine.stop()
        runs = json.loads(stream_out.read_text())["runs"]
    for case in cases:
        case["worst_gap_ms"] = worst_gaps(runs, case.pop("t0"), case.pop("t1"))
    gaps = [b - a for r in runs for a, b in itertools.pairwise(r["arrivals"])]
    report = {
        "slot_tokens": args.slot_tokens, "body_cap_bytes": cap_bytes(args.slot_tokens), "cases": cases,
        "stream_tokens": sum(r["tokens"] for r in runs), "stream_errors": [r["error"] for r in runs if r["error"]][:5],
        "worst_gap_ms": round(max(gaps, default=0) * 1000, 1), "rss_end_mb": round(rss_end / 2**20, 1),
    }
    out = args.json or RESULTS / f"body-stalls-{args.slot_tokens}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{'case':58} {'status':>10} {'ms':>16} {'gap ms':>8} {'+RSS MB':>8}")
    for c in cases:
        print(f"{c['case']:58} {c['status']!s:>10} {c['ms'][:3]!s:>16} {c['worst_gap_ms']:>8} {c['rss_growth_mb']:>8}")
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
