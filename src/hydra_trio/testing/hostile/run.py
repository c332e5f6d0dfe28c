"""Running it: the engine process, the actors and the reader together, then the solo
phase and the health afterwards; ``main`` is ``python -m benchmarks.hostile``."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio

from .. import rpcframes as frames
from .. import rpcfuzz as fuzz
from ..process import EngineProcess
from .campaign import Campaign
from .campaign_config import GOAL_GAP_MS, RUNTIME_ALLOWANCE_MIB, SHORT, STOPPED, Config, Ledger
from .report import _first_traceback, _ms, _rss_peak, _span_ms, analyse, render
from .streams import read_streams

# ---- running it ---------------------------------------------------------------------------------


def budget_bytes(model: Path, ctx: int, args: dict[str, int]) -> dict[str, int]:
    from hydra_trio.model.synthetic import PRESETS

    p = PRESETS["tiny"]
    kv = 2 * p.n_layer * (p.n_embd * p.n_head_kv // p.n_head) * 2 * ctx  # K and V, f16, every cell
    parts = {
        "model": model.stat().st_size,
        "kv_cache": kv,
        "max_inflight_bytes": args["max_inflight_bytes"],
        "cache_ram": args["cache_ram_mib"] << 20,
        "kv_export_max_bytes": args["kv_export_max_bytes"],
        "runtime_allowance": RUNTIME_ALLOWANCE_MIB << 20,
    }
    parts["total"] = sum(parts.values())
    return parts


async def run(
    engine: EngineProcess, cfg: Config, seeds: frames.Seeds
) -> tuple[Ledger, list[tuple[float, int]]]:
    ledger = Ledger()
    campaign = Campaign(engine, cfg, ledger)
    await campaign.capture_export()
    rss: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(campaign.watch_process, rss)
        await nursery.start(campaign.traps)
        ended: dict[str, float] = ledger.notes.setdefault("actor_ended_at_s", {})

        async def timed(name: str, fn: Any, *args: Any) -> None:
            # When each actor stopped: one that overruns the deadline says which waits are long.
            await fn(*args)
            ended[name] = round(time.monotonic() - campaign.t0, 1)

        async with trio.open_nursery() as load:
            load.start_soon(timed, "health_probe", campaign.health_probe)
            load.start_soon(timed, "rpc_fuzzer", campaign.rpc_fuzzer, seeds)
            load.start_soon(timed, "idle_connections", campaign.idle_connections)
            load.start_soon(timed, "shapes", campaign.shapes)
            load.start_soon(timed, "surfaces", campaign.surfaces)
            for i in range(cfg.http_fuzzers):
                load.start_soon(timed, f"http_fuzzer{i}", campaign.http_fuzzer, i)
            for i in range(cfg.drippers):
                load.start_soon(timed, f"dripper{i}", campaign.dripper, i)
            for i in range(cfg.stalled_readers):
                load.start_soon(timed, f"stalled_reader{i}", campaign.stalled_reader, i)
        if cfg.solo_s > 0:
            await campaign.solo()
        nursery.cancel_scope.cancel()  # the traps and the watcher
    ledger.notes["load_s"] = round(time.monotonic() - campaign.t0, 1)
    return ledger, rss


async def after(engine: EngineProcess, settle_s: float) -> dict[str, Any]:
    """Once everything hostile has stopped: slots back to idle, no decode running, /health
    and a well-formed request and DECODE work (fuzz.engine_health)."""
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as h:
        t0 = time.monotonic()
        with trio.move_on_after(settle_s):
            while any(s["is_processing"] for s in (await h.get("/slots")).json()):  # noqa: ASYNC110 (an HTTP poll)
                await trio.sleep(0.1)
        out["slots_idle_after_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        out["health_status"] = (await h.get("/health")).status_code
        out["health_ms"] = round((time.monotonic() - t0) * 1000, 1)
        r = await h.post(
            "/v1/completions", json={"prompt": "hello world", "max_tokens": 8, "temperature": 0}
        )
        out["completion_ok"] = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        out["server_itl"] = _server_itl((await h.get("/metrics")).text)
        out.update(await fuzz.engine_health(engine.rpc_port, h, settle_s=settle_s))
    out["ok"] = bool(out["ok"] and out["completion_ok"] and out["health_status"] == 200)
    return out


def _server_itl(metrics_text: str) -> dict[str, int]:
    """The engine's own inter-token gaps (vllm:inter_token_latency_seconds, every request
    that generated): how many exceeded 0.2 s and 0.3 s, its bucket bounds around the goal.
    Beside the client's gaps, this tells the engine's delays from the client's own (a
    stream reader not scheduled on a busy machine)."""
    from prometheus_client.parser import text_string_to_metric_families

    le: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:inter_token_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    le[bound] = le.get(bound, 0.0) + sample.value
    total = le.get(float("inf"), 0.0)
    return {
        "gaps": int(total),
        "over_0.2_s": int(total - le.get(0.2, total)),
        "over_0.3_s": int(total - le.get(0.3, total)),
    }


def campaign(cfg: Config, *, log_dir: Path, engine_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start an engine, run the campaign, stop it; the report (a dict)."""
    from hydra_trio.model.synthetic import write_model

    model = write_model(log_dir / "tiny.gguf", "tiny", seed=0)
    flags = {"max_inflight_bytes": 64 << 20, "cache_ram_mib": 16, "kv_export_max_bytes": 16 << 20}
    # 2048 cells a slot; enough slots that the well-formed streams never wait for one behind
    # the stalled readers, drips, fuzzed generations and RPC DECODEs (--slot-wait-s 5).
    slots, ctx = 16, 32768
    engine = EngineProcess(
        str(model),
        slots=slots,
        ctx_size=ctx,
        threads=1,
        batch_size=64,
        extra=(
            "--max-inflight-bytes",
            str(flags["max_inflight_bytes"]),
            "--cache-ram-mib",
            str(flags["cache_ram_mib"]),
            "--kv-export-max-bytes",
            str(flags["kv_export_max_bytes"]),
            "--slot-wait-s",
            "5",
            "--shutdown-grace-s",
            "3",  # the exports the KV-pull shapes leave unpulled would hold the stop 10 s
            "--kv-pull-timeout-s",
            "1",  # a failed pull answers at its deadline: the fuzzed params' pulls, quickly
            *engine_args,
        ),
    )
    engine.start(log_dir, "engine")
    stream_out = log_dir / "streams.json"
    try:
        rss_start = engine.rss_bytes()
        seeds = trio.run(
            frames.capture_seeds, engine.rpc_port
        )  # needs slots 0 and 1 free: before any load
        # The well-formed streams, read in their own process (see read_streams).
        reader = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hydra_trio.testing.hostile",
                "--stream-reader",
                str(engine.http_port),
                str(cfg.streams),
                str(cfg.duration_s + cfg.solo_s + 2 * cfg.hang_s),
                str(cfg.stream_tokens),
                str(cfg.hang_s),
                str(stream_out),
            ],
            cwd=Path(__file__).resolve().parents[1],
        )
        ledger, rss = trio.run(run, engine, cfg, seeds)
        stream_out.with_suffix(".stop").touch()  # the streams end with the load
        try:
            reader.wait(timeout=cfg.hang_s + 30)
        except subprocess.TimeoutExpired:
            reader.kill()
            ledger.find("hang", "the stream reader did not finish")
        alive = engine.proc is not None and engine.proc.poll() is None
        health = trio.run(after, engine, min(30.0, cfg.hang_s)) if alive else {"ok": False}
        peak = engine.peak_rss_bytes() if alive else max((b for _, b in rss), default=0)
    finally:
        engine.stop()
    code = engine.proc.returncode if engine.proc is not None else None
    log_text = engine.log_path.read_text(errors="replace") if engine.log_path else ""
    timed = json.loads(stream_out.read_text()) if stream_out.exists() else {}
    runs = timed.get("runs", [])
    for err in timed.get("health_errors", [])[:20]:
        ledger.find("health_error", f"/health from the stream reader: {err}")
    streams = analyse(runs, ledger.spans)
    for r in runs:
        if r["error"].startswith("HANG"):
            ledger.find("hang", f"well-formed stream {r['stream']}: {r['error']}")
        elif r["error"] != STOPPED and (r["error"] or not r["done"]):
            ledger.find(
                "stream_error", f"well-formed stream {r['stream']}: {r['error'] or 'no [DONE]'}"
            )
    if not health.get("ok"):
        ledger.find("unhealthy_after", json.dumps(health))
    if "Traceback" in log_text:
        ledger.notes["first_traceback"] = _first_traceback(log_text)
    # The engine's own unhandled errors (a bug of ours), apart from Hypercorn's (see docs/reliability.md).
    for line in log_text.splitlines():
        if "unhandled error in" in line or "background task" in line:
            ledger.find("unhandled_error_in_log", line)
        elif "Error in ASGI Framework" in line:
            ledger.find("hypercorn_error_in_log", line)
    budget = budget_bytes(model, ctx, flags)
    kinds: Counter[str] = Counter()
    for key, n in ledger.counts.items():
        if not key.startswith(("FINDING", "mutation ")):
            kinds[key] += n
    findings = {k: len(v) for k, v in ledger.findings.items()}
    crashes = max(findings.get("crash", 0), 0 if alive else 1)
    hm = ledger.health_ms
    gap_max = streams["gap_ms"].get("max", float("nan"))
    report: dict[str, Any] = {
        "config": {**cfg.__dict__, "slots": slots, "ctx_size": ctx, **flags},
        "requests": sum(n for k, n in kinds.items() if not k.startswith("rpc frames")),
        "rpc_frames": kinds.get("rpc frames", 0),
        "by_kind_and_status": dict(sorted(kinds.items())),
        "by_mutation_and_status": dict(
            sorted((k[9:], n) for k, n in ledger.counts.items() if k.startswith("mutation "))
        ),
        "findings": findings,
        "finding_examples": {k: v[:5] for k, v in ledger.findings.items()},
        "crashes": crashes,
        "hangs": findings.get("hang", 0),
        "server_errors_5xx": findings.get("server_error", 0),
        "engine_exit_code": code,
        "engine_alive_at_end": alive,
        "tracebacks_in_log": log_text.count("Traceback"),
        "rss_mb": {
            "start": round(rss_start / 2**20, 1),
            "peak": round(peak / 2**20, 1),
            **_rss_peak(rss, ledger.spans),
            "budget": round(budget["total"] / 2**20, 1),
            "budget_parts_mb": {k: round(v / 2**20, 2) for k, v in budget.items()},
        },
        "request_ms_by_kind": _span_ms(ledger.spans),
        "health_ms": _ms(hm),  # from the driver (busy itself)
        "health_ms_light_client": _ms(
            timed.get("health_ms", [])
        ),  # from the stream reader's process
        "after": health,
        "streams": streams,
        "notes": {k: v for k, v in ledger.notes.items() if not k.startswith("_")},
    }
    report["goals"] = {
        "0 crashes": crashes == 0 and alive,
        "0 hangs": report["hangs"] == 0,
        "RSS within budget": peak <= budget["total"],
        f"worst stream gap <= {GOAL_GAP_MS:g} ms": bool(gap_max <= GOAL_GAP_MS),
    }
    report["clean"] = not findings and alive and code == 0
    return report


def main(argv: list[str] | None = None, *, results: Path = Path("benchmarks") / "results") -> int:
    """``python -m benchmarks.hostile``; the report goes to ``results`` unless --json says."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stream-reader"]:  # the stream reader's own process
        port, n, dur, tokens, hang, out = argv[1:7]
        read_streams(int(port), int(n), float(dur), int(tokens), float(hang), Path(out))
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.hostile", description="Hostile-client campaign: everything a bad or broken client "
        "can send, at once."
    )
    ap.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="how long the load runs (default 60; --short: 5)",
    )
    ap.add_argument("--short", action="store_true", help="the CI form: a few seconds, fewer actors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=None, help="a reply later than this is a hang")
    ap.add_argument("--json", type=Path, default=None, help="where to write the report")
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the engine's log (and the streams' timings) here",
    )
    ap.add_argument(
        "--engine-args",
        default="",
        help="more `hydra-trio serve` flags, e.g. '--kv-pull-allow 0.0.0.0/0' to see the KV-pull trap fire",
    )
    args = ap.parse_args(argv)
    cfg = SHORT if args.short else Config()
    cfg = Config(**{**cfg.__dict__, "seed": args.seed})
    if args.duration_s is not None:
        cfg.duration_s = args.duration_s
    if args.hang_s is not None:
        cfg.hang_s = args.hang_s
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        report = campaign(
            cfg, log_dir=args.log_dir, engine_args=tuple(shlex.split(args.engine_args))
        )
    else:
        with tempfile.TemporaryDirectory(prefix="hydra-hostile-") as tmp:
            report = campaign(
                cfg, log_dir=Path(tmp), engine_args=tuple(shlex.split(args.engine_args))
            )
    out = args.json or results / ("hostile-short.json" if args.short else "hostile.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(render(report))
    print(f"report: {out}")
    return 0 if report["clean"] else 1


