"""The front-end ceiling: what a server costs per streamed token when the model costs nothing.

    python -m benchmarks.ceiling [--streams 1,16,64,128] [--tokens 220] [--rounds 2]
                                 [--with-llama-server | --llama-server PATH] [--profile]
                                 [--burst N [--burst-streams 64]] [--churn]

The synthetic ``tiny`` model (0.6 MB) on one llama thread makes a step nearly free, so what
is left is the server's own work per token: waking the request, detokenizing, framing SSE,
sending. Both servers get the same new prompts in each round (streaming ``/v1/completions``,
greedy, ``ignore_eos``, so every stream produces exactly ``--tokens`` tokens), from one
client process that reads every stream through ``selectors`` with raw sockets (a few us a
chunk, so the client does not decide the result; its CPU is reported). Figures per server and
stream count: aggregate tok/s, inter-token latency p50/p99 as the client sees it, and the
server's CPU per streamed token (all threads, from /proc/PID/stat), with the trio thread's
share for hydra-trio (/proc/PID/task/PID/schedstat). ``--profile`` samples the trio thread with
py-spy at the largest stream count and writes the top frames to the results folder
(``--profile-gil``: only its Python). The time hydra-trio spent inside llama_decode
(``hydra_llama_decode_seconds_total``) gives the bound of any front end on this compute:
the rate if the model's compute were the only cost, against llama-server's measured rate.
``--burst N`` adds N rounds of ``--burst-streams`` requests sent at once, 2 tokens each: the
cost of a request rather than of a token (the burst's wall time, the median first token, the
server's CPU per request), each followed by as many ``GET /health`` at once: what a request
costs the server's HTTP stack before any work of the route. ``--churn`` runs, unmeasured before each round, ``--slots``
streams of seeded random lengths, so the slots' last uses are in a scrambled order, as a day
of requests of every length leaves them (the slot choice then decides whether a round's
streams land on a run of slots or all over them: a split KV cache steps a gap apart).

Timing goals live here, never in tests: the ratios printed are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from hydra_trio.testing.workload import Stream, completion_request, consume

from .harness import EngineProcess, env_info, metric_value, percentile, words_prompt
from .llama_server import LlamaServer, find_or_build

RESULTS = Path(__file__).resolve().parent / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of a process, or of one of its threads."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu_s(pid: int, tid: int) -> float:
    """One thread's CPU seconds, in ns resolution (schedstat's first field)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def run_round(
    port: int, prompts: list[str], n_tokens: int, timeout_s: float = 600, sampling: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One streaming completion per prompt, all at once, each read to its end (``sampling``:
    keys that replace greedy's)."""
    reqs = [completion_request(port, p, n_tokens, sampling) for p in prompts]
    return _read_streams(port, reqs, n_tokens, time.perf_counter(), timeout_s)


def run_health_burst(port: int, n: int, timeout_s: float = 60) -> dict[str, Any]:
    """``n`` connections at once, each one ``GET /health`` read to its close: what a request
    costs a server before any work of its own (accept, parse, route, answer, close). As a
    round's dict with one "token" per request, so ``measure`` gives CPU per request."""
    t0 = time.perf_counter()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=timeout_s) for _ in range(n)]
    for sock in socks:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
    for sock in socks:
        read_reply(sock)
        sock.close()
    return {"streams": n, "tokens": n, "wall_s": time.perf_counter() - t0}


def read_reply(sock: socket.socket) -> bytes:
    """One HTTP/1.1 reply with a Content-Length body, read to its end (a server may keep
    the connection open after it, as Hypercorn does despite ``Connection: close``)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        None,
    )
    while length is None or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def run_decode_round(
    port: int, rpc_port: int, prompts: list[str], n_tokens: int, timeout_s: float = 600
) -> dict[str, Any]:
    """The same streams as DECODE requests, each on its own slot with its prompt and no KV
    (the engine prefills it), read over SSE (``GET /v1/decode/{id}``): the DECODE result
    stream's cost per token against the completion stream's. Timed from the first DECODE;
    generation starts at each ack, so a reader that connects late first gets a replay."""
    import trio

    from hydra_trio.rpc.client import RpcClient, build_decode_frame

    async def submit() -> list[int]:
        async with await RpcClient.connect("127.0.0.1", rpc_port) as rpc:
            rids = []
            for slot, p in enumerate(prompts):
                body = {"prompt": p, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
                rids.append(int((await rpc.decode(slot, build_decode_frame(body))).meta["decode_request_id"]))
            return rids

    t0 = time.perf_counter()
    rids = trio.run(submit)
    head = "GET /v1/decode/{} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n"
    return _read_streams(port, [head.format(rid, port).encode() for rid in rids], n_tokens, t0, timeout_s)


def _read_streams(port: int, requests: list[bytes], n_tokens: int, t0: float, timeout_s: float) -> dict[str, Any]:
    """Send each request on its own connection and read every SSE stream to its end, through
    ``selectors`` with raw sockets: aggregate tok/s from ``t0``, the gaps between chunks."""
    sel = selectors.DefaultSelector()
    streams = []
    for req in requests:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        st = Stream(sock, req)
        sock.sendall(st.request)  # small: fits the socket buffer at once
        sel.register(sock, selectors.EVENT_READ, st)
        streams.append(st)
    open_n = len(streams)
    deadline = t0 + timeout_s
    while open_n and time.perf_counter() < deadline:
        for key, _ in sel.select(timeout=1.0):
            st = key.data
            now = time.perf_counter()
            try:
                chunk = st.sock.recv(1 << 16)
            except BlockingIOError:
                continue
            if chunk:
                st.buf += chunk
                consume(st, now)
                if not st.done:
                    continue
            # The stream ended ([DONE]) or the server closed it: hang up (a keep-alive
            # server need not close first).
            sel.unregister(st.sock)
            st.sock.close()
            open_n -= 1
    wall = time.perf_counter() - t0
    for st in streams:
        if st.sock.fileno() >= 0:
            sel.unregister(st.sock)
            st.sock.close()
            st.error = st.error or "timed out"
    gaps = [b - a for st in streams for a, b in zip(st.arrivals, st.arrivals[1:], strict=False)]
    tokens = sum(st.tokens or len(st.arrivals) for st in streams)
    return {
        "streams": len(streams),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50_ms": percentile([st.arrivals[0] - t0 for st in streams if st.arrivals], 50) * 1000,
        "itl_p50_ms": percentile(gaps, 50) * 1000,
        "itl_p99_ms": percentile(gaps, 99) * 1000,
        "errors": [st.error for st in streams if st.error or not st.done],
        "short_streams": sum(1 for st in streams if (st.tokens or len(st.arrivals)) < n_tokens),
    }


def churn(port: int, n_streams: int, n_tokens: int, seed: int) -> None:
    """Unmeasured: ``n_streams`` streams of lengths 1..``n_tokens`` (seeded), which end, and
    free their slots, in a scrambled order."""
    import random

    rng = random.Random(seed)
    reqs = [
        completion_request(
            port, f"churn{seed} {i} " + words_prompt(12, seed=50_000 + seed * 1000 + i), rng.randint(1, n_tokens)
        )
        for i in range(n_streams)
    ]
    _read_streams(port, reqs, n_tokens, time.perf_counter(), 600)


def worker_busy_s(port: int) -> float:
    """hydra-trio's GPU-worker wall time so far (its /metrics counter): the worker's time per
    token against its step time says whether the worker or the trio thread sets the pace."""
    return metric_value(f"http://127.0.0.1:{port}", "hydra_gpu_worker_busy_seconds_total")


def wait_slots_free(port: int) -> None:
    """Until no slot is claimed (a DECODE names its slot: the last round's must be free)."""
    while metric_value(f"http://127.0.0.1:{port}", "hydra_slots_busy") > 0:
        time.sleep(0.05)


def decode_s(port: int) -> float:
    """hydra-trio's time inside llama_decode so far: tokens over it are the rate of a server
    whose every other cost were nil, the bound of any front end on this compute."""
    return metric_value(f"http://127.0.0.1:{port}", "hydra_llama_decode_seconds_total")


def measure(name: str, port: int, pid: int, trio_tid: int | None, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()`` (one round of streams) with the server's and the client's CPU around it."""
    # The /metrics scrapes stay outside the CPU windows: they are neither server nor client work.
    w0, d0 = (worker_busy_s(port), decode_s(port)) if trio_tid else (0.0, 0.0)
    c0, t0 = cpu_s(pid), thread_cpu_s(pid, trio_tid) if trio_tid else 0.0
    me0 = time.process_time()
    r = run()
    r["client_cpu_us_per_token"] = (time.process_time() - me0) / max(1, r["tokens"]) * 1e6
    r["server_cpu_us_per_token"] = (cpu_s(pid) - c0) / max(1, r["tokens"]) * 1e6
    if trio_tid:
        r["trio_thread_cpu_us_per_token"] = (thread_cpu_s(pid, trio_tid) - t0) / max(1, r["tokens"]) * 1e6
        r["worker_busy_us_per_token"] = (worker_busy_s(port) - w0) / max(1, r["tokens"]) * 1e6
        r["decode_us_per_token"] = (decode_s(port) - d0) / max(1, r["tokens"]) * 1e6
    r["server"] = name
    return r


def profile_trio_thread(pid: int, seconds: int, out: Path, *, gil: bool = False) -> str | None:
    """Top frames of the trio thread (py-spy, when installed), written to ``out``. ``gil``:
    only samples that hold the GIL, so its Python, without the system calls it waits in and
    the waits for the GIL after them (which plain samples charge to the calling line)."""
    if shutil.which("py-spy") is None:
        return None
    raw = out.with_suffix(".txt")
    subprocess.run(
        ["py-spy", "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "250",
         "--format", "raw", "--output", str(raw), "--nonblocking", *(["--gil"] if gil else [])],
        check=False, capture_output=True,
    )
    return str(raw) if raw.exists() else None


def profile_summary(raw: str, top: int = 20) -> list[str]:
    """The trio thread's frames by share of its samples (inclusive), from py-spy's raw
    output (stacks of other threads, which start in Thread._bootstrap, are left out)."""
    incl: dict[str, int] = {}
    total = 0
    for line in Path(raw).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or stack.startswith("Thread._bootstrap"):
            continue
        total += int(count)
        for frame in set(stack.split(";")):
            incl[frame] = incl.get(frame, 0) + int(count)
    ranked = sorted(incl.items(), key=lambda kv: -kv[1])
    skip = ("<frozen runpy>", "hydra_trio/cli.py", "<module>")
    return [f"{100 * n / total:5.1f}% {f}" for f, n in ranked if not any(x in f for x in skip)][:top] if total else []


def engine_alone(
    model: Path, slots: int, slot_ctx: int, counts: list[int], rounds: int, n_tokens: int
) -> list[dict[str, Any]]:
    """The engine without HTTP, in this process: the batcher, the GPU worker and one request
    task per stream calling ``Engine.generate``, each token's text discarded. What one trio
    process streams when the front end costs nothing: the bound of this design."""
    import trio

    from hydra_trio.engine.engine import GenerationResult
    from hydra_trio.engine.params import GenerationParams, SamplingParams
    from hydra_trio.local import local_engines, local_settings

    rows: list[dict[str, Any]] = []

    async def run() -> None:
        settings = local_settings(
            str(model), slots=slots, ctx_size=slots * slot_ctx, threads=1,
            batch_size=max(512, slots), step_token_budget=max(32, slots),
        )
        params = GenerationParams(n_tokens, SamplingParams(temperature=0.0, ignore_eos=True), stream=True)

        async def discard(_text: str) -> None:
            return None

        async with local_engines(settings) as (ep,):
            eng = ep.state.engine
            for rnd in range(rounds):
                for n in counts:
                    prompts = [f"alone{rnd} {i} " + words_prompt(12, seed=5000 + 1000 * rnd + i) for i in range(n)]
                    made = 0

                    async def one(prompt: str) -> None:
                        nonlocal made
                        tokens = await eng.prompt_tokens(prompt)  # a request's own work, as over HTTP
                        async with eng.claim("ceiling", prompt=tokens) as lease:
                            res = await lease.generate(tokens, params, discard, result=GenerationResult())
                            made += res.completion_tokens  # after the await: "made +=" would read it before

                    t0, c0 = time.perf_counter(), time.process_time()
                    async with trio.open_nursery() as nursery:
                        for prompt in prompts:
                            nursery.start_soon(one, prompt)
                    row = {
                        "server": "engine alone",
                        "streams": n,
                        "round": rnd,
                        "tokens": made,
                        "tok_s": made / (time.perf_counter() - t0),
                        "cpu_ms_per_request": (time.process_time() - c0) / n * 1000,
                    }
                    rows.append(row)
                    print(f"round {rnd} engine alone {n:4d} streams: {row['tok_s']:8.0f} tok/s", flush=True)

    trio.run(run)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,16,64,128")
    ap.add_argument("--tokens", type=int, default=220)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slots", type=int, default=128, help="slots of both servers (the most streams at once)")
    ap.add_argument("--slot-ctx", type=int, default=512, help="KV cells per slot")
    ap.add_argument("--extra", default="", help="more hydra-trio serve flags, e.g. '--kv-unified'")
    ap.add_argument("--with-llama-server", action="store_true")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--profile", action="store_true", help="py-spy the trio thread at the largest stream count (see "
                    "--profile-streams)")
    ap.add_argument("--profile-streams", type=int, default=0, help="streams of the profiled run (default: the largest "
                    "of --streams)")
    ap.add_argument("--decode", action="store_true", help="also stream each round as DECODE requests read over GET "
                    "/v1/decode/{id} (SSE), on hydra-trio")
    ap.add_argument("--burst", type=int, default=0, metavar="N",
                    help="also N rounds of a request burst: --burst-streams streams of 2 tokens at once (the cost of a "
                    "request, not of a token)")
    ap.add_argument("--burst-streams", type=int, default=64)
    ap.add_argument("--profile-gil", action="store_true", help="profile only the trio thread's Python (py-spy --gil: "
                    "samples holding the GIL)")
    ap.add_argument("--churn", action="store_true", help="before each round, --slots unmeasured streams of random "
                    "lengths: the slots' last uses scrambled")
    ap.add_argument("--engine-alone", action="store_true", help="also run the engine without HTTP, in this process "
                    "(after the servers; with --burst, its bursts too)")
    ap.add_argument("--out", default=str(RESULTS / "ceiling.json"))
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    work = Path(tempfile.mkdtemp(prefix="hydra-ceiling-"))
    from hydra_trio.model.synthetic import write_model

    model = work / "tiny.gguf"
    write_model(model, "tiny", seed=0)
    ctx = args.slots * args.slot_ctx
    binary = find_or_build(args.llama_server, args.with_llama_server)
    ours = EngineProcess(
        str(model), slots=args.slots, ctx_size=ctx, threads=1, batch_size=max(512, args.slots),
        extra=[*args.extra.split(), "--step-token-budget", str(max(32, args.slots))],
    ).start(work, "hydra-trio")
    peer = (
        LlamaServer(binary, str(model), ctx=ctx, slots=args.slots, log_dir=work, tag="llama-server", threads=1)
        if binary
        else None
    )
    results: dict[str, Any] = {"env": env_info(), "args": vars(args), "rows": [], "burst": []}
    # (name, HTTP port, pid, trio thread id), in the order of even rounds; odd ones reverse it.
    both: list[tuple[str, int, int, int | None]] = [("hydra-trio", ours.http_port, ours.pid, ours.pid)]
    if peer is not None:
        both.append(("llama-server", peer.port, peer.proc.pid, None))
    try:
        for rnd in range(args.rounds):
            if args.churn:
                for _name, port, _pid, _tid in both:
                    churn(port, args.slots, args.tokens, seed=rnd)
            for n in counts:
                prompts = [f"{chr(97 + (i + rnd * 7) % 26)}"
                           f"{chr(97 + (i // 26) % 26)} " + words_prompt(12, seed=1000 * rnd + i) for i in range(n)]
                servers = both if rnd % 2 == 0 else both[::-1]
                runs = [
                    (name, port, pid, tid, partial(run_round, port, prompts, args.tokens))
                    for name, port, pid, tid in servers
                ]
                if args.decode:
                    wait_slots_free(ours.http_port)
                    runs.append(
                        (
                            "hydra-trio DECODE",
                            ours.http_port,
                            ours.pid,
                            ours.pid,
                            partial(run_decode_round, ours.http_port, ours.rpc_port, prompts, args.tokens),
                        )
                    )
                for name, port, pid, tid, run in runs:
                    row = measure(name, port, pid, tid, run)
                    row["round"] = rnd
                    results["rows"].append(row)
                    print(
                        f"round {rnd} {name:12s} {n:4d} streams: {row['tok_s']:8.0f} tok/s  ITL p50 "
                        f"{row['itl_p50_ms']:.2f} ms"
                        f" p99 {row['itl_p99_ms']:.2f} ms  server {row['server_cpu_us_per_token']:.0f} us/token"
                        + (f" (trio thread {row['trio_thread_cpu_us_per_token']:.0f}, worker busy "
                           f"{row['worker_busy_us_per_token']:.0f}, llama_decode "
                           f"{row['decode_us_per_token']:.0f})" if "trio_thread_cpu_us_per_token" in row else "")
                        + f"  client {row['client_cpu_us_per_token']:.0f} us/token"
                        + (f"  ERRORS {row['errors'][:2]}" if row["errors"] else ""),
                        flush=True,
                    )
        for rnd in range(args.burst):
            prompts = [
                f"{chr(97 + rnd % 26)}{i} " + words_prompt(12, seed=7000 + 100 * rnd + i)
                for i in range(args.burst_streams)
            ]
            for name, port, pid, tid in both if rnd % 2 == 0 else both[::-1]:
                row = measure(name, port, pid, tid, partial(run_round, port, prompts, BURST_TOKENS))
                row.update(burst=True, round=rnd)
                results["burst"].append(row)
                health = measure(name, port, pid, tid, partial(run_health_burst, port, args.burst_streams))
                row["health_cpu_ms_per_request"] = health["server_cpu_us_per_token"] / 1000
                print(f"burst {rnd} {name:12s} {row['streams']} requests: {row['wall_s'] * 1000:.0f} ms, first token "
                      f"p50 {row['ttft_p50_ms']:.0f} ms,"
                      f" server {per_request(row, 'server_cpu_us_per_token'):.2f} ms CPU/request"
                      f" (GET /health: {row['health_cpu_ms_per_request']:.2f})", flush=True)
        if args.profile:
            n = args.profile_streams or max(counts)
            prompts = [f"p{i} " + words_prompt(12, seed=99 + i) for i in range(n)]
            import threading

            box: dict[str, Any] = {}
            th = threading.Thread(target=lambda: box.setdefault("r", run_round(ours.http_port, prompts, args.tokens)))
            th.start()
            time.sleep(0.5)
            out = Path(args.out)
            results["profile"] = profile_trio_thread(
                ours.pid, 5, out.with_name(f"{out.stem}-profile-{n}"), gil=args.profile_gil
            )
            th.join()
            if results["profile"]:
                results["profile_top"] = profile_summary(results["profile"])
                print(f"trio thread at {n} streams, share of samples (inclusive):", *results["profile_top"], sep="\n  ")
    finally:
        ours.stop()
        if peer is not None:
            peer.stop()
    if args.engine_alone:
        results["engine_alone"] = engine_alone(model, args.slots, args.slot_ctx, counts, args.rounds, args.tokens)
        if args.burst:
            # The same bursts without HTTP: the request's cost in the engine (tokenize, slot
            # choice, prompt cache, prefill, two steps), the rest of a burst's being the server's.
            alone = engine_alone(model, args.slots, args.slot_ctx, [args.burst_streams], args.burst, BURST_TOKENS)
            results["engine_alone_burst"] = alone
            print(f"engine alone, bursts of {args.burst_streams}: CPU ms/request",
                  ", ".join(f"{r['cpu_ms_per_request']:.2f}" for r in alone), flush=True)
    results["table"] = render(results["rows"], results.get("engine_alone", []))
    if results["burst"]:
        results["table"] += "\n\n" + render_burst(results["burst"])
    print(results["table"])
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"results: {args.out}")
    return 0


def render(rows: list[dict[str, Any]], alone: Sequence[dict[str, Any]] = ()) -> str:
    """Per stream count: the median over rounds of each figure, and ours / llama-server's
    (with --engine-alone, a last column: the engine without HTTP / llama-server; with
    --decode, a second table: DECODE result streams against completion streams)."""
    import statistics

    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in [*rows, *alone]:
        by.setdefault((r["server"], r["streams"]), []).append(r)
    counts = sorted({r["streams"] for r in rows})
    extra = (" engine alone tok/s (/ llama-server) |", "---|") if alone else ("", "")
    out = [
        "| streams | llama-server tok/s | hydra-trio tok/s | ratio | ITL p50 / p99 ms (ours) | server CPU µs/token, "
        "llama-server / ours (trio thread)"
        " | llama_decode µs/token (bound: its rate / llama-server) |" + extra[0],
        "|---|---|---|---|---|---|---|" + extra[1],
    ]

    def med(server: str, n: int, key: str) -> float:
        vals = [r[key] for r in by.get((server, n), []) if key in r]
        return statistics.median(vals) if vals else float("nan")

    def cpu(server: str, n: int) -> str:
        """The server's CPU per token, with the trio thread's share."""
        return f"{med(server, n, 'server_cpu_us_per_token'):.0f} ({med(server, n, 'trio_thread_cpu_us_per_token'):.0f})"

    for n in counts:
        ls, ht = med("llama-server", n, "tok_s"), med("hydra-trio", n, "tok_s")
        out.append(
            f"| {n} | {ls:,.0f} | {ht:,.0f} | **{ht / ls:.2f}×** | {med('hydra-trio', n, 'itl_p50_ms'):.2f} / "
            f"{med('hydra-trio', n, 'itl_p99_ms'):.2f} |"
            f" {med('llama-server', n, 'server_cpu_us_per_token'):.0f} / {cpu('hydra-trio', n)} |"
            f" {(dec := med('hydra-trio', n, 'decode_us_per_token')):.0f} ({1e6 / dec / ls:.2f}×) |"
            + (f" {med('engine alone', n, 'tok_s'):,.0f} "
               f"({med('engine alone', n, 'tok_s') / ls:.2f}×) |" if alone else "")
        )
    if any(r["server"] == "hydra-trio DECODE" for r in rows):
        out += [
            "",
            "| streams | completion streams tok/s | DECODE streams tok/s | DECODE / completion | server CPU µs/token, "
            "completion / DECODE (trio thread) |",
            "|---|---|---|---|---|",
        ]
        for n in counts:
            ht, dc = med("hydra-trio", n, "tok_s"), med("hydra-trio DECODE", n, "tok_s")
            out.append(f"| {n} | {ht:,.0f} | {dc:,.0f} | **{dc / ht:.2f}×** | {cpu('hydra-trio', n)} / "
                       f"{cpu('hydra-trio DECODE', n)} |")
    return "\n".join(out)


BURST_TOKENS = 2  # a burst measures requests: each stream gets its first token and one more


def per_request(row: dict[str, Any], key: str) -> float:
    """A per-token CPU figure of a burst row as ms per request."""
    return row[key] * row["tokens"] / max(1, row["streams"]) / 1000


def render_burst(rows: list[dict[str, Any]]) -> str:
    """A burst of requests at once, per server (medians over the rounds): how long until
    the last stream ends and until the median first token, and the CPU each request costs
    the server (with the trio thread's share for hydra-trio), and what a burst of as many
    ``GET /health`` costs it a request (the HTTP floor under any route)."""
    import statistics

    out = [
        "| server | requests at once | burst wall ms | first token p50 ms | server CPU ms/request (trio thread) | GET "
        "/health CPU ms/request |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("llama-server", "hydra-trio"):
        mine = [r for r in rows if r["server"] == name]
        if not mine:
            continue

        def med(key: str, rs: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in rs)

        trio = (
            f" ({statistics.median(per_request(r, 'trio_thread_cpu_us_per_token') for r in mine):.2f})"
            if "trio_thread_cpu_us_per_token" in mine[0]
            else ""
        )
        out.append(
            f"| {name} | {mine[0]['streams']} | {med('wall_s') * 1000:.0f} | {med('ttft_p50_ms'):.0f} |"
            f" {statistics.median(per_request(r, 'server_cpu_us_per_token') for r in mine):.2f}{trio} |"
            f" {statistics.median(r.get('health_cpu_ms_per_request', float('nan')) for r in mine):.2f} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
