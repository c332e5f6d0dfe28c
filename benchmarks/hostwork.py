"""A token's host work, by part: what the engine does outside ``llama_decode`` per step and per
token, at 1, 8 and 64 streams, on the tiny model and on Gemma 3 270M (262,144-token
vocabulary), with llama-server's rate and ``llama-bench``'s ``tg`` beside it.

    python -m benchmarks.hostwork [--models tiny,gemma] [--streams 1,8,64] [--tokens 128]
        [--rounds 2] [--threads 1] [--llama-server PATH | --with-llama-server]
        [--llama-bench PATH] [--out benchmarks/results/hostwork.json]
    python -m benchmarks.hostwork --steps-ab [--models tiny,gemma] [--streams 1,8,64]
        [--tokens 64] [--rounds 3] [--sampling greedy,seeded] [--out ...]

Per model, three servers get the same new prompts in every round (streaming
``/v1/completions``, greedy, ``ignore_eos``; benchmarks/ceiling.py's raw-socket client), the
order turning each round: this engine as it ships (``plain``: the headline, the GPU worker's
busy time less ``llama_decode``, from /metrics, as issue 53 measured it), the same engine with
the probes of benchmarks/hostwork_probes.py (``probed``: each part's CPU time on its thread,
the worker's and the trio thread's; on a shared machine wall time mostly measures the waits
for a core, CPU time what the part costs), and llama-server. A GPU computes a step of these models in about 1-1.5 ms:
host work on the worker adds to every step, host work on the trio thread overlaps the next decode
unless it holds the GIL the worker needs.

``--steps-ab``: the sampling paths side by side (issue 53, Deliver 3), on the worker's side
alone: one process, the model's LlamaBackend, every stream greedy (``ignore_eos``) or seeded
(temperature 0.8 and llama.cpp's other defaults), its steps run one after another as the
batcher's run does, the probes on; per round and stream count the path before
(``--no-sampling-fast-path``) and the fast path take turns, the order turning each round, on
the same prompts. Per token: the worker's CPU outside llama_decode by part, and its wall time.
No HTTP, no trio: what differs is the sampling alone.

Goals (issue 53): at most 100 us a token outside llama_decode at one stream on Gemma's
vocabulary, at most 25 us at 64 streams; one stream on the tiny model at least 0.9x
``llama-bench``'s tg rate. The machine is shared: read the ratios of one round, not the rates.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .ceiling import decode_s, measure, run_round, worker_busy_s
from .harness import EngineProcess, env_info, wait_http, words_prompt
from .llama_server import LlamaServer, cached_binary, find_or_build

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
# What requests ask: greedy (the default) or seeded (temperature 0.8, llama.cpp's other defaults).
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"ignore_eos": True},
    "seeded": {"temperature": 0.8, "seed": 1234, "ignore_eos": True},
}
WORKER_PARTS = ["llama_decode", "batch fill", "step composition", "logits read", "sampling", "constraint"]
TRIO_PARTS = ["detokenize", "stop check", "stream-out", "scheduling"]


class ProbedEngine(EngineProcess):
    """``hydra-trio serve`` with the probes in (hostwork_probes.serve); ``dump()`` reads their
    totals."""

    dump_path: Path | None = None

    def start(self, log_dir: Path, name: str) -> ProbedEngine:
        self.log_path = log_dir / f"{name}.log"
        self.dump_path = log_dir / f"{name}-probes.json"
        cmd = [
            sys.executable, "-m", "benchmarks.hostwork", "--probe-serve", str(self.dump_path), "--",
            "--model", self.model, "--port", str(self.http_port), "--rpc-port", str(self.rpc_port),
            "--slots", str(self.slots), "--ctx-size", str(self.ctx_size), "--threads", str(self.threads),
            "--batch-size", str(self.batch_size), "--default-n-predict", "64", "--log-level", "WARNING", *self.extra,
        ]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_http(self.url + "/health", self.proc, timeout=300)
        return self

    def dump(self) -> dict[str, list[int]]:
        assert self.dump_path is not None
        before = self.dump_path.stat().st_mtime_ns if self.dump_path.exists() else 0
        os.kill(self.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.dump_path.exists() and self.dump_path.stat().st_mtime_ns != before:
                return json.loads(self.dump_path.read_text())["parts"]  # type: ignore[no-any-return]
            time.sleep(0.01)
        raise TimeoutError("the probed engine did not write its totals")


def parts_delta(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    out = {}
    for part in b:
        ns = b[part][0] - a.get(part, [0, 0])[0]
        calls = b[part][1] - a.get(part, [0, 0])[1]
        out[part] = {"s": ns / 1e9, "calls": calls}
    return out


def split_row(
    row: dict[str, Any], parts: dict[str, dict[str, float]], worker_s: float, trio_cpu_s: float
) -> dict[str, Any]:
    """Per token and per step (us) of each part (CPU time of its thread), and what no probe
    covers: on the worker, its busy wall time outside the steps' and prompts' outermost
    probes; on the trio thread, its CPU time outside the parts' probes."""
    tokens = max(1, row["tokens"])
    steps = max(1, int(parts.get("step composition", {}).get("calls", 0)))
    get = lambda p: parts.get(p, {}).get("s", 0.0)  # noqa: E731
    by_part = {p: get(p) for p in WORKER_PARTS + TRIO_PARTS + ["prefill"]}
    outer_wall = get("step composition (outermost, wall)") + get("prefill (outermost, wall)")
    by_part["worker other (wall)"] = max(0.0, worker_s - outer_wall)
    # Inside the steps, the worker's wall time its thread was not on a core: the GIL held by
    # the trio thread, or the core taken by another process (a shared VM).
    by_part["waits in steps (wall)"] = max(
        0.0, get("step composition (outermost, wall)") - get("step composition (outermost, cpu)")
    )
    by_part["trio other"] = max(0.0, trio_cpu_s - sum(get(p) for p in TRIO_PARTS))
    host_cpu = sum(get(p) for p in WORKER_PARTS if p != "llama_decode")
    # The trio thread's parts (outermost probes, wall time): how much of it ran while the
    # worker was inside llama_decode (overlapped with the model's compute), and what did not.
    wall = {p: get(f"{p} (outermost, wall)") for p in TRIO_PARTS}
    during = {p: get(f"{p} (outermost, during decode)") for p in TRIO_PARTS}
    overlap = {
        "trio_parts_wall_us_per_token": sum(wall.values()) / tokens * 1e6,
        "trio_parts_not_overlapped_us_per_token": (sum(wall.values()) - sum(during.values())) / tokens * 1e6,
        "trio_parts_overlapped_share": sum(during.values()) / sum(wall.values()) if sum(wall.values()) else None,
        "by_part": {p: during[p] / wall[p] if wall[p] else None for p in TRIO_PARTS},
    }
    return {
        "tokens": row["tokens"], "steps": steps, "tokens_per_step": row["tokens"] / steps,
        "us_per_token": {p: v / tokens * 1e6 for p, v in by_part.items()},
        "us_per_step": {p: v / steps * 1e6 for p, v in by_part.items()},
        # The goal's figure, robust to a busy machine: the worker's CPU outside llama_decode.
        "worker_cpu_outside_decode_us_per_token": host_cpu / tokens * 1e6,
        "worker_cpu_outside_decode_us_per_step": host_cpu / steps * 1e6,
        "overlap": overlap,
    }


def llama_bench_tg(binary: Path | None, model: str, threads: int, n: int) -> dict[str, Any] | None:
    if binary is None:
        return None
    r = subprocess.run([str(binary), "-m", model, "-p", "0", "-n", str(n), "-t", str(threads), "-r", "5", "-o", "json"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"error": r.stderr[-500:]}
    rows = json.loads(r.stdout)
    return {"tg_tok_s": rows[0]["avg_ts"], "stddev": rows[0]["stddev_ts"], "n_gen": n, "threads": threads}


def find_llama_bench(path: str | None) -> Path | None:
    if path:
        return Path(path) if Path(path).is_file() else None
    from importlib.metadata import version

    cand = cached_binary(version("llama-cpp-python")).with_name("llama-bench")
    return cand if cand.is_file() else (Path(w) if (w := shutil.which("llama-bench")) else None)


def run_model(
    label: str, model: str, args: argparse.Namespace, peer_bin: Path | None, bench_bin: Path | None, work: Path
) -> dict[str, Any]:
    counts = [int(x) for x in args.streams.split(",")]
    slots = max(counts)
    ctx = slots * 512
    common = dict(slots=slots, ctx_size=ctx, threads=args.threads, batch_size=max(512, slots),
                  extra=["--step-token-budget", str(max(32, slots))])
    plain = EngineProcess(model, **common).start(work, f"{label}-plain")  # type: ignore[arg-type]
    probed = ProbedEngine(model, **common).start(work, f"{label}-probed")  # type: ignore[arg-type]
    old_path = None
    if args.ab:  # the engine with the sampling path before issue 53's fast path
        extra = [*common["extra"], "--no-sampling-fast-path"]  # type: ignore[list-item]
        old_path = EngineProcess(model, **{**common, "extra": extra}).start(work, f"{label}-plain-before")  # type: ignore[arg-type]
    peer = (
        LlamaServer(
            peer_bin, model, ctx=ctx, slots=slots, log_dir=work, tag=f"{label}-llama-server", threads=args.threads
        )
        if peer_bin
        else None
    )
    out: dict[str, Any] = {"model": model, "levels": {}}
    try:
        out["llama_bench"] = llama_bench_tg(bench_bin, model, args.threads, args.tokens)
        for rnd, n, sampling in (
            (r, n, s) for r in range(args.rounds + 1) for n in counts for s in args.sampling.split(",")
        ):
            # round 0 warms every server up, unmeasured
            prompts = [f"{chr(97 + (rnd * 7 + i) % 26)}"
                       f"{chr(97 + (i // 26) % 26)}{rnd} " + words_prompt(12, seed=1000 * rnd + i) for i in range(n)]
            servers: list[tuple[str, Any]] = [("plain", plain), ("probed", probed)] + (
                [("plain-before", old_path)] if old_path else []
            )
            servers += [("llama-server", peer)] if peer else []
            level = str(n) if sampling == "greedy" else f"{n} {sampling}"
            k = rnd % len(servers)
            for name, srv in servers[k:] + servers[:k]:
                port = srv.port if name == "llama-server" else srv.http_port
                pid = srv.proc.pid
                tid = None if name == "llama-server" else pid  # the trio thread is the main thread
                if name == "probed":
                    before = srv.dump()
                    w0, d0 = worker_busy_s(port), decode_s(port)
                n_tokens = args.tokens if rnd else 4  # the warm-up: kernels and slots, briefly
                row = measure(
                    name,
                    port,
                    pid,
                    tid,
                    lambda p=port, ps=prompts, k=n_tokens, s=SAMPLINGS[sampling]: run_round(p, ps, k, sampling=s),
                )
                if name == "probed":
                    parts = parts_delta(before, srv.dump())
                    # The trio thread's CPU in measure's own window: the /metrics scrapes around
                    # it (rendered on that thread, several ms each) are not the tokens' work.
                    trio_cpu = row["trio_thread_cpu_us_per_token"] * row["tokens"] / 1e6
                    row["split"] = split_row(row, parts, worker_busy_s(port) - w0, trio_cpu)
                    row["split"]["decode_metric_s"] = decode_s(port) - d0
                if name != "llama-server":
                    row["worker_outside_decode_us_per_token"] = (
                        row["worker_busy_us_per_token"] - row["decode_us_per_token"]
                    )
                if rnd == 0:
                    continue
                row["round"], row["sampling"], row["load"] = rnd, sampling, os.getloadavg()[0]
                out["levels"].setdefault(level, []).append(row)
                extra = (
                    f", worker outside decode {row['worker_outside_decode_us_per_token']:.0f} us/token wall"
                    if name != "llama-server"
                    else ""
                )
                if name == "probed":
                    extra += f", {row['split']['worker_cpu_outside_decode_us_per_token']:.1f} us CPU"
                print(f"[{label}] round {rnd} {n:3d} streams {sampling:6s} {name:12s}: {row['tok_s']:8.1f} "
                      f"tok/s{extra}", flush=True)
    finally:
        plain.stop()
        probed.stop()
        if old_path is not None:
            old_path.stop()
        if peer is not None:
            peer.stop()
    return out


def summarise(label: str, res: dict[str, Any]) -> list[str]:
    lines = []
    tg = (res.get("llama_bench") or {}).get("tg_tok_s")
    for n, rows in res["levels"].items():
        by = {
            name: [r for r in rows if r["server"] == name]
            for name in ("plain", "probed", "plain-before", "llama-server")
        }
        med = lambda name, key, by=by: statistics.median(r[key] for r in by[name]) if by[name] else float("nan")  # noqa: E731
        cpu = (
            statistics.median(r["split"]["worker_cpu_outside_decode_us_per_token"] for r in by["probed"])
            if by["probed"]
            else float("nan")
        )
        line = (f"{label} {n} streams: plain {med('plain', 'tok_s'):.0f} tok/s, worker busy outside llama_decode "
                f"{med('plain', 'worker_outside_decode_us_per_token'):.0f} us/token wall (probed: worker CPU outside "
                f"llama_decode {cpu:.1f} us/token)")
        if by["plain-before"]:
            ratios = [p["tok_s"] / q["tok_s"] for p, q in zip(by["plain"], by["plain-before"], strict=True)]
            line += (f"; the sampling path before (--no-sampling-fast-path) {med('plain-before', 'tok_s'):.0f} tok/s, "
                     f"{med('plain-before', 'worker_outside_decode_us_per_token'):.0f} us/token outside llama_decode "
                     f"(fast path / before: {statistics.median(ratios):.2f}x tok/s)")
        if by["llama-server"]:
            ratios = [p["tok_s"] / q["tok_s"] for p, q in zip(by["plain"], by["llama-server"], strict=True)]
            line += f"; llama-server {med('llama-server', 'tok_s'):.0f} tok/s ({statistics.median(ratios):.2f}x)"
        if tg and n == "1":
            line += f"; llama-bench tg {tg:.0f} tok/s ({med('plain', 'tok_s') / tg:.2f}x)"
        lines.append(line)
        if by["probed"]:
            parts = {
                p: statistics.median(r["split"]["us_per_token"][p] for r in by["probed"])
                for p in by["probed"][0]["split"]["us_per_token"]
            }
            steps = statistics.median(r["split"]["tokens_per_step"] for r in by["probed"])
            lines.append("    per token (us): " + ", ".join(f"{p} {v:.1f}" for p, v in parts.items() if p != "prefill")
                         + f"; {steps:.1f} tokens a step")
            ov = [
                r["split"]["overlap"]
                for r in by["probed"]
                if r["split"].get("overlap", {}).get("trio_parts_overlapped_share") is not None
            ]
            if ov:
                lines.append(
                    "    trio parts (detokenize, stop check, stream-out, scheduling): "
                    f"{statistics.median(o['trio_parts_wall_us_per_token'] for o in ov):.1f} us/token wall, "
                    f"{100 * statistics.median(o['trio_parts_overlapped_share'] for o in ov):.0f}% of it while the "
                    "worker was inside llama_decode "
                    f"({statistics.median(o['trio_parts_not_overlapped_us_per_token'] for o in ov):.1f} us/token not)")
    return lines


def steps_ab(label: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The worker's host work per token, the path before against the fast path, in one process."""
    from hydra_trio.engine.llama.context import LlamaBackend
    from hydra_trio.engine.llama.types import StepRequest
    from hydra_trio.engine.sample import Sampler, SamplingParams

    from . import hostwork_probes as probes

    probes.install()
    counts = [int(x) for x in args.streams.split(",")]
    n_slots = max(counts)
    backend = LlamaBackend(
        model, n_slots=n_slots, n_ctx=n_slots * 256, n_threads=args.threads, n_batch=max(512, n_slots)
    )
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds + 1):  # round 0 warms up, unmeasured
            for n in counts:
                prompts = [
                    backend.tokenize(
                        f"{chr(97 + (rnd * 7 + i) % 26)}{rnd} " + words_prompt(12, seed=1000 * rnd + i),
                        add_special=True,
                    )
                    for i in range(n)
                ]
                for sampling in args.sampling.split(","):
                    paths = [("before", False), ("fast", True)]
                    for path, fast in paths[rnd % 2:] + paths[: rnd % 2]:
                        samplers = [Sampler(SamplingParams(**SAMPLINGS[sampling]), fast_path=fast) for _ in range(n)]
                        tokens = []
                        for slot, prompt in enumerate(prompts):
                            backend.clear_slot(slot)
                            tok, _ = backend.eval_chunk(slot, prompt, None, sampler=samplers[slot])
                            tokens.append(tok)
                        n_steps = args.tokens if rnd else 4
                        before, d0 = probes.snapshot(), backend.decode_s
                        t0, c0 = time.perf_counter(), time.thread_time()
                        for _ in range(n_steps):
                            res = backend.step([StepRequest(s, tokens[s], samplers[s], n_steps + 1) for s in range(n)])
                            tokens = [r[-1] for r in res]  # type: ignore[index]
                        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                        parts = parts_delta(before, probes.snapshot())
                        decode = backend.decode_s - d0
                        for sampler in samplers:
                            sampler.close()
                        if not rnd:
                            continue
                        made = n * n_steps
                        by_part = {p: parts.get(p, {}).get("s", 0.0) / made * 1e6 for p in WORKER_PARTS}
                        outside = cpu - parts.get("llama_decode", {}).get("s", 0.0)
                        row = {"round": rnd, "streams": n, "sampling": sampling, "path": path, "tokens": made,
                               "decode_ms_per_step": decode / n_steps * 1e3,
                               "worker_cpu_outside_decode_us_per_token": outside / made * 1e6,
                               "worker_wall_outside_decode_us_per_token": (wall - decode) / made * 1e6,
                               "us_per_token": by_part, "load": os.getloadavg()[0]}
                        rows.append(row)
                        print(f"[{label}] round {rnd} {n:3d} streams {sampling:6s} {path:6s}: decode "
                              f"{row['decode_ms_per_step']:7.2f} ms/step, "
                              f"outside it {row['worker_cpu_outside_decode_us_per_token']:7.1f} us/token CPU "
                              f"({row['worker_wall_outside_decode_us_per_token']:.1f} wall); sampling "
                              f"{by_part['sampling']:.1f}", flush=True)
    finally:
        backend.close()
    return {"model": model, "rows": rows}


def summarise_ab(label: str, res: dict[str, Any]) -> list[str]:
    lines = []
    rows = res["rows"]
    for n in sorted({r["streams"] for r in rows}):
        for sampling in dict.fromkeys(r["sampling"] for r in rows):
            pick = {
                p: [r for r in rows if r["streams"] == n and r["sampling"] == sampling and r["path"] == p]
                for p in ("before", "fast")
            }
            if not pick["before"] or not pick["fast"]:
                continue
            cpu = {p: [r["worker_cpu_outside_decode_us_per_token"] for r in pick[p]] for p in pick}
            smp = {p: statistics.median(r["us_per_token"]["sampling"] for r in pick[p]) for p in pick}
            ratio = [b / a for a, b in zip(cpu["before"], cpu["fast"], strict=True)]
            lines.append(
                f"{label} {n} streams {sampling}: worker CPU outside llama_decode before "
                f"{statistics.median(cpu['before']):.1f} "
                f"[{min(cpu['before']):.1f}-{max(cpu['before']):.1f}], fast {statistics.median(cpu['fast']):.1f} "
                f"[{min(cpu['fast']):.1f}-{max(cpu['fast']):.1f}] us/token ({statistics.median(ratio):.2f}x); "
                f"sampling {smp['before']:.1f} -> {smp['fast']:.1f} us/token"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe-serve"]:  # the probed engine's own process
        from .hostwork_probes import serve

        return serve(argv[3:], Path(argv[1]))
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hostwork", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,gemma", help="tiny (synthetic), gemma (Gemma "
                    "3 270M, the realmodel extra)")
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="llama threads of every server and llama-bench")
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--with-llama-server", action="store_true")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="default: beside the cached llama-server")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/hostwork.json (--steps-ab: "
                    "hostwork-steps-ab.json)")
    ap.add_argument("--steps-ab", action="store_true", help="the path before against the fast path, the worker's side "
                    "in one process")
    ap.add_argument("--sampling", default=None, help="greedy, seeded (temperature 0.8, seed 1234); default: greedy "
                    "(--steps-ab: both)")
    ap.add_argument("--ab", action="store_true", help="a third engine beside plain and probed: --no-sampling-fast-path "
                    "(the path before)")
    args = ap.parse_args(argv)
    args.sampling = args.sampling or ("greedy,seeded" if args.steps_ab else "greedy")
    args.out = args.out or RESULTS / ("hostwork-steps-ab.json" if args.steps_ab else "hostwork.json")
    models: dict[str, str] = {}
    for m in args.models.split(","):
        if m == "tiny":
            from .__main__ import build_models

            cache = Path.home() / ".cache" / "hydra-trio" / "bench"
            cache.mkdir(parents=True, exist_ok=True)
            models["tiny"] = build_models(cache, ["tiny"])["tiny"]
        elif m == "gemma":
            from hydra_trio.model.registry import ModelPackageMissing, named_model_path

            try:
                models["gemma"] = str(named_model_path("gemma3-270m"))
            except ModelPackageMissing as exc:
                print(f"gemma skipped: {exc}")
        else:
            ap.error(f"--models: unknown model {m!r} (tiny, gemma)")
    if args.steps_ab:
        result = {
            "config": {k: str(v) for k, v in vars(args).items()},
            "env": env_info(),
            "load_before": os.getloadavg(),
            "models": {},
        }
        for label, path in models.items():
            result["models"][label] = steps_ab(label, path, args)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        result["load_after"] = os.getloadavg()
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"load average before {result['load_before']}, after {result['load_after']}")
        for label, res in result["models"].items():
            print("\n".join(summarise_ab(label, res)))
        print(f"wrote {args.out}")
        return 0
    peer_bin = find_or_build(args.llama_server, args.with_llama_server)
    bench_bin = find_llama_bench(args.llama_bench)
    if bench_bin is None:
        print("llama-bench not found (--llama-bench PATH): no tg rate beside")
    work = Path(tempfile.mkdtemp(prefix="hydra-hostwork-"))
    result: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "env": env_info(),
                              "load_before": os.getloadavg(), "models": {}}
    for label, path in models.items():
        result["models"][label] = run_model(label, path, args, peer_bin, bench_bin, work)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    result["load_after"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    for label, res in result["models"].items():
        print("\n".join(summarise(label, res)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
