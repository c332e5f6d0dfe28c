"""`python -m benchmarks.transport [--preset bench] [--sizes 1024,4096] [--repeats 3] [--with-llama-server]`

The hand-off at memory speed (issue "KV at half the bytes, ... without a socket copy"):
time to first token on the decode engine of a P/D hand-off (``kv_transfer_params``, as
vllm-router sends it) over TCP and over shared memory (``--kv-shm-dir``: the decode engine
maps the prefill engine's export), with an f16 and a q8_0 KV cache, against llama-server
restoring the same prompt's slot file and producing its first token with the same cache
type. Also: blob bytes per token for each type, and whether a q8_0 hand-off's greedy text
equals a q8_0 engine's own. Engines are separate processes on loopback; the prompt is
prefilled once per size and exported again for each repeat (the slot still holds it: an
export then costs only its copy). Writes benchmarks/results/transport-<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx

from hydra_trio.testing.sse_reader import sse_chunk

from .__main__ import RESULTS, build_models
from .figures import Tokenizer, chat_request
from .harness import EngineProcess, env_info, summary
from .llama_server import LlamaServer, find_or_build, slot_restore_ttft_ms

PD = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
      "remote_block_ids": None, "remote_host": None, "remote_port": None}
CACHE = {"f16": ["--cache-type-k", "f16", "--cache-type-v", "f16"],
         "q8_0": ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]}


def export(p: EngineProcess, req: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(p.url + "/v1/chat/completions", json={**req, "max_tokens": 1, "kv_transfer_params": PD}, timeout=900)
    r.raise_for_status()
    return r.json()


def decode_stream(d: EngineProcess, req: dict[str, Any], params: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
    """A streamed DECODE of ``req`` with ``params`` on the decode engine: (its start, its first
    content token, both ``time.perf_counter()``; the reply's kv_transfer)."""
    body = {**req, "kv_transfer_params": params, "stream": True}
    first, kv = None, {}
    t0 = time.perf_counter()
    with httpx.Client(timeout=900) as c, c.stream("POST", d.url + "/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if (chunk := sse_chunk(line)) is None:
                continue
            if first is None and any(ch["delta"].get("content") for ch in chunk.get("choices") or []):
                first = time.perf_counter()
            kv = chunk.get("kv_transfer") or kv
    if first is None:
        raise RuntimeError("stream ended without any text")
    return t0, first, kv


def decode_ttft(d: EngineProcess, req: dict[str, Any], params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(ms to the first content token on the decode engine, the reply's kv_transfer)."""
    t0, first, kv = decode_stream(d, req, params)
    return (first - t0) * 1000.0, kv


def run(args: argparse.Namespace) -> dict[str, Any]:
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    model = build_models(cache, [args.preset])[args.preset]
    log_dir = RESULTS / f"transport-{args.preset}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(model)
    sizes = [int(s) for s in args.sizes.split(",")]
    binary = find_or_build(args.llama_server, args.with_llama_server)
    rows: dict[str, Any] = {}
    for kind, flags in CACHE.items():
        common = [*flags, "--flash-attn", "on"]
        p = EngineProcess(model, slots=1, ctx_size=8192, extra=common).start(log_dir, f"transport-p-{kind}")
        d = EngineProcess(model, slots=1, ctx_size=8192, extra=[*common, "--kv-shm-dir", ""]).start(
            log_dir, f"transport-d-{kind}"
        )
        try:
            for n in sizes:
                req = chat_request(tok.content_for(n, seed=n), 8)
                first = export(p, req)  # the prefill: once per size
                times: dict[str, list[float]] = {"shm": [], "tcp": [], "shm_pull": [], "tcp_pull": [], "restore": []}
                kv_bytes, n_past = 0, 0
                for _ in range(args.repeats):
                    for transport in ("shm", "tcp"):
                        params = export(p, req)["kv_transfer_params"]
                        kv_bytes, n_past = params["hydra"]["kv_bytes"], params["hydra"]["n_past"]
                        if transport == "tcp":  # a probe it cannot read: the bytes go over TCP
                            params["hydra"].pop("shm", None)
                        ms, kv = decode_ttft(d, req, params)
                        assert kv.get("status") == "restored" and kv.get("transport") == transport, kv
                        times[transport].append(ms)
                        times[f"{transport}_pull"].append(kv["pull_ms"])
                        times["restore"].append(kv["restore_ms"])
                # Greedy text: the hand-off against one engine alone (same shapes: a whole
                # prompt evaluation, then steps), and the transport actually used.
                handed = httpx.post(
                    d.url + "/v1/chat/completions",
                    json={**req, "kv_transfer_params": export(p, req)["kv_transfer_params"]},
                    timeout=900,
                ).json()
                httpx.post(d.url + "/slots/0?action=erase", timeout=60)
                alone = httpx.post(d.url + "/v1/chat/completions", json=req, timeout=900).json()
                rows[f"{kind}-{n}"] = {
                    "cache_type": kind,
                    "tokens": n_past,
                    "kv_bytes": kv_bytes,
                    "bytes_per_token": kv_bytes / n_past,
                    "prefill_ms": first["kv_export"]["prefill_ms"],
                    "shm_ttft_ms": summary(times["shm"]),
                    "tcp_ttft_ms": summary(times["tcp"]),
                    "shm_pull_ms": summary(times["shm_pull"]),
                    "tcp_pull_ms": summary(times["tcp_pull"]),
                    "restore_ms": summary(times["restore"]),
                    "prompt": httpx.post(
                        f"{d.url}/apply-template", json={"messages": req["messages"]}, timeout=60
                    ).json()["prompt"],
                    "transport_seen": handed.get("kv_transfer", {}).get("transport"),
                    "same_text_as_one_engine": handed["choices"][0]["message"]["content"]
                    == alone["choices"][0]["message"]["content"],
                }
                print(f"{kind} {n_past} tokens: shm {rows[f'{kind}-{n}']['shm_ttft_ms']['median']:.0f} ms, "
                      f"tcp {rows[f'{kind}-{n}']['tcp_ttft_ms']['median']:.0f} ms, {kv_bytes / 1e6:.0f} MB", flush=True)
        finally:
            p.stop()
            d.stop()
        if binary is not None:
            ls_flags = ["-ctk", kind, "-ctv", kind, "-fa", "on"]
            with LlamaServer(
                binary, model, ctx=8192, slots=1, log_dir=log_dir, tag=f"llama-server-{kind}", extra=ls_flags
            ) as server:
                for n in sizes:
                    row = rows[f"{kind}-{n}"]  # the prompt as this engine renders it: the same tokens
                    row["llama_server_restore_ttft_ms"] = slot_restore_ttft_ms(server, row["prompt"], args.repeats)[
                        "ttft_ms"
                    ]
    return rows


def table(rows: dict[str, Any]) -> str:
    lines = ["| cache | tokens | blob bytes/token | TTFT shm (pull) | TTFT tcp (pull) | restore | llama-server restore "
             "| shm / llama-server | same text |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
        shm, tcp = r["shm_ttft_ms"]["median"], r["tcp_ttft_ms"]["median"]
        ls = r.get("llama_server_restore_ttft_ms")
        peer, ratio = (f"{ls['median']:.0f} ms", f"{shm / ls['median']:.2f}x") if ls else ("-", "-")
        pulls = (r["shm_pull_ms"]["median"], r["tcp_pull_ms"]["median"])
        lines.append(f"| {r['cache_type']} | {r['tokens']} | {r['bytes_per_token']:.0f} | {shm:.0f} ms "
                     f"({pulls[0]:.1f}) | "
                     f"{tcp:.0f} ms ({pulls[1]:.1f}) | {r['restore_ms']['median']:.1f} ms | {peer} | {ratio} | "
                     f"{r['same_text_as_one_engine']} |")
    by = {(r["cache_type"], r["tokens"]): r for r in rows.values()}
    for (kind, n), r in by.items():
        if kind == "q8_0" and ("f16", n) in by:
            f16 = by[("f16", n)]
            lines.append(f"q8_0 / f16 at {n} tokens: blob {r['kv_bytes'] / f16['kv_bytes']:.2f}x, "
                         f"TCP TTFT {r['tcp_ttft_ms']['median'] / f16['tcp_ttft_ms']['median']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-llama-server", action="store_true")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "hydra-trio" / "bench"))
    args = ap.parse_args(argv)
    rows = run(args)
    out = RESULTS / f"transport-{args.preset}.json"
    out.write_text(
        json.dumps({"preset": args.preset, "repeats": args.repeats, "rows": rows, "env": env_info()}, indent=1)
    )
    print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
