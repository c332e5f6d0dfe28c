"""`python -m benchmarks.handoff_engine_parts [--tokens 4096] [--repeats 5] [--tree NAME=SRC ...]`

Where a TCP hand-off's time goes in the real engines, by part (issue 53): a prefill and a
decode engine (f16 KV, flash attention, one slot each, as ``benchmarks.transport``) on
loopback, the prompt prefilled and exported, then DECODE requests (``kv_transfer_params``
without the shared-memory probe: the bytes go over TCP), streamed. Both engines run with
``benchmarks/handoff_probe.py`` installed, which stamps the parts (one clock for every
process): the driver's send and first content token, and inside the engines

- decode: HTTP in (to ``Engine.prepare``; the chat plan with its template; tokenizing;
  the rest up to the hand-off's route), the identity gate, the pull
  (resolve, connect and request, reply head, receive buffer, receive + hash, verify),
  the admission of the pulled blob, the slot claim, llama.cpp's restore, first token out;
- prefill: the KV_PULL op and its reply's send loop.

``--tree NAME=SRC`` (repeatable) runs the same rounds against other source trees, the
engines of every tree up at once and the rounds interleaved (A/B in one run; default: this
tree alone). Prints the median of each part per tree with the load average, and writes
benchmarks/results/handoff-engine-parts.json (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from hydra_trio.testing.process import EngineProcess

from .__main__ import RESULTS, build_models
from .figures import Tokenizer, chat_request
from .handoff_probe import SITECUSTOMIZE, read
from .harness import env_info
from .transport import decode_stream, export

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--cache-type-k", "f16", "--cache-type-v", "f16", "--flash-attn", "on"]

# (part, from stamp, to stamp): "t0" and "first" are the driver's; "admit2" the second admission.
PARTS = [
    ("http_in", "t0", "route>"),
    ("to_prepare", "t0", "prepare>"),
    ("chat_plan", "plan>", "plan<"),
    ("tokenize", "tokenize>", "tokenize<"),
    ("prepare", "prepare>", "prepare<"),
    ("to_route", "prepare<", "route>"),
    ("gate", "gate>", "gate<"),
    ("to_pull", "gate<", "pull>"),
    ("resolve", "resolve>", "resolve<"),
    ("connect_request", "resolve<", "reply_head>"),
    ("reply_head", "reply_head>", "reply_head<"),
    ("buffer", "buffer>", "buffer<"),
    ("to_receive", "buffer<", "receive>"),
    ("receive_hash", "receive>", "receive<"),
    ("verify", "receive<", "verify<"),
    ("to_admit", "verify<", "admit2>"),
    ("admit", "admit2>", "admit2<"),
    ("pull_total", "pull>", "pull<"),
    ("fetch_tail", "admit2<", "fetch<"),
    ("claim_slot", "fetch<", "restore_handoff>"),
    ("llama_restore", "llama_restore>", "llama_restore<"),
    ("restore_total", "restore_handoff>", "restore_handoff<"),
    ("first_token_out", "restore_handoff<", "first"),
    ("ttft", "t0", "first"),
    ("p_kv_pull_op", "p_kv_pull>", "p_kv_pull<"),
    ("p_send", "p_send>", "p_send<"),
    ("p_send_end_to_received", "p_send<", "receive<"),
]


def _stamps(decode: str, prefill: str, t0: float, t_first: float) -> dict[str, float]:
    """The first stamp of each name inside the round's window (the second admission: admit2)."""
    out: dict[str, float] = {"t0": t0, "first": t_first}
    for path in (decode, prefill):
        for name, t in read(path):
            if not t0 <= t <= t_first + 1.0:
                continue
            if name.startswith("admit") and "receive<" in out and path == decode:
                name = name.replace("admit", "admit2")
            out.setdefault(name, t)
    return out


def _round(d: EngineProcess, p: EngineProcess, req: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
    params = export(p, req)["kv_transfer_params"]
    params["hydra"].pop("shm", None)  # over TCP
    t0, first, kv = decode_stream(d, req, params)
    if kv.get("status") != "restored" or kv.get("transport") != "tcp":
        raise RuntimeError(f"not a TCP hand-off: {kv}")
    return t0, first, kv


def run(args: argparse.Namespace) -> dict[str, Any]:
    cache = Path(args.cache)
    model = build_models(cache, [args.preset])[args.preset]
    tok = Tokenizer(model)
    req = chat_request(tok.content_for(args.tokens, seed=args.tokens), 8)
    log_dir = RESULTS / "handoff-engine-parts-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="handoff-probe-"))
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {"this": str(ROOT / "src")}
    running: dict[str, tuple[EngineProcess, EngineProcess, str, str]] = {}
    rows: dict[str, Any] = {"load_before": os.getloadavg(), "trees": trees}
    try:
        for name, src in trees.items():
            probes = (str(tmp / f"{name}-d.tsv"), str(tmp / f"{name}-p.tsv"))
            env = lambda out, src=src: {**os.environ, "HYDRA_PROBE_OUT": out,  # noqa: E731
                                        "PYTHONPATH": f"{tmp}:{src}:{ROOT}"}
            p = EngineProcess(model, slots=1, ctx_size=8192, extra=COMMON, env=env(probes[1]))
            d = EngineProcess(model, slots=1, ctx_size=8192, extra=[*COMMON, "--kv-shm-dir", ""], env=env(probes[0]))
            running[name] = (p.start(log_dir, f"p-{name}"), d.start(log_dir, f"d-{name}"), *probes)
            export(p, req)  # the prefill, once
            _round(d, p, req)  # warm both sides (first buffers, first connections)
        per: dict[str, list[dict[str, float]]] = {n: [] for n in trees}
        for _ in range(args.repeats):
            for name, (p, d, dprobe, pprobe) in running.items():
                t0, first, kv = _round(d, p, req)
                s = _stamps(dprobe, pprobe, t0, first)
                per[name].append({part: (s[b] - s[a]) * 1000.0 for part, a, b in PARTS if a in s and b in s}
                                 | {"reported_pull_ms": kv["pull_ms"], "reported_restore_ms": kv["restore_ms"]})
    finally:
        for p, d, *_ in running.values():
            p.stop()
            d.stop()
    rows["load_after"] = os.getloadavg()
    rows["rounds"] = per
    rows["median"] = {n: {k: statistics.median(r[k] for r in rs if k in r) for k in rs[0]} for n, rs in per.items()}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tree", action="append", default=[], help="NAME=SRC: a source tree to run (repeatable)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "hydra-trio" / "bench"))
    ap.add_argument("--out", default=str(RESULTS / "handoff-engine-parts.json"))
    args = ap.parse_args(argv)
    res = run(args)
    names = list(res["median"])
    print("part".ljust(24) + "".join(n.rjust(12) for n in names))
    for part in res["median"][names[0]]:
        print(part.ljust(24) + "".join(f"{res['median'][n].get(part, float('nan')):12.1f}" for n in names))
    print(f"load {res['load_before']} -> {res['load_after']}")
    Path(args.out).write_text(json.dumps({**res, "env": env_info()}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
