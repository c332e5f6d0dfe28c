"""`python -m benchmarks.speculative [--model gemma|tiny] [--rounds N] [--threads N] [--streams 1,8]
[--workloads copy,edit,free,sampled] [--spec-max-batch N] [--draft-n-max N] [--check-logits]
[--llama-server PATH | --with-llama-server]`

What n-gram speculative decoding (``--spec-type ngram-simple``) buys, side by side in one
run: one engine (a subprocess, as in production) started with speculation on, each request
sent once with its own ``"speculative": {"type": "none"}`` and once without it, back to
back in every round, so both see the same machine. Workloads (plain completion prompts: the
real model is a base model, see WORKLOADS):

- copy: a passage, then "Exact copy:" (the reply repeats it word for word),
- edit: a rename shown once on a small function, then asked of a larger piece of code (the
  reply rewrites the code, with changes of its own here and there),
- free: the start of a story with no text to copy (a small model comes back to its own
  phrases, though),
- sampled: the same story sampled at temperature 1 (drafts mostly miss: what speculation
  costs; each stream its own seed, the same in both runs),

at 1 and 8 streams (each stream the same workload, its own slot). Printed per round:
aggregate completion tok/s without and with speculation (the order alternating by round;
both find the prompt already in their slots), their ratio, the acceptance rate
(accepted / drafted tokens, from /metrics) and how many replies came out the same text.

Greedy replies but for "sampled". On a real model llama.cpp's CPU logits of a position are not bit-for-bit the
same when a batch evaluates one position or several (measured: docs/performance.md), so a
near-tie can pick differently: the "same" column says how often that happened.
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
import trio
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import EngineProcess, env_info, sample_value

RESULTS = Path(__file__).resolve().parent / "results"

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens until it shone, and wrote the weather in a leather book: wind from "
    "the north, a grey swell, two fishing boats returning late. In forty years the light had never "
    "failed, not in the storm of the long winter, not on the night the supply ship ran aground on "
    "the southern rocks. When the new electric lamp arrived, he kept the old book on the shelf by "
    "the door, and on quiet nights he still wrote the weather in it."
)
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
# Gemma 3 270M is a base model: a chat template only makes it echo the template's markers
# (the chat prompts of earlier runs gave "<|im_end|>" over and over, not the passage), so
# each workload is a plain completion prompt written to get that behaviour from a base model
# (its greedy replies: the passage word for word; the code again with changes of its own; a
# story that comes back to its own phrases).
RENAME_SHOT = "def area(w, h):\n    return w * h\n"
STORY = "Chapter 1\n\nThe robot had never held a brush before. On the first morning in the studio,"
WORKLOADS: dict[str, str] = {
    "copy": f"Below is a passage, followed by an exact copy of it.\n\nPassage:\n{PASSAGE}\n\nExact copy:\n",
    "edit": (f"# Before:\n{RENAME_SHOT}\n# After renaming `w` to `width`:\n"
             f"{RENAME_SHOT.replace('w,', 'width,').replace('w *', 'width *')}\n"
             f"# Before:\n{CODE}\n# After renaming `items` to `products`:\n"),
    "free": STORY,
    "sampled": STORY,
}
# A workload's own sampling (the others are greedy): drafts mostly miss, the cost side.
SAMPLING: dict[str, dict[str, Any]] = {"sampled": {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "min_p": 0.0}}
OFF = {"type": "none"}


def _model(name: str, cache: Path) -> str:
    if name == "gemma":
        from hydra_trio.model.registry import named_model_path

        return str(named_model_path("gemma3-270m"))
    from hydra_trio.model.synthetic import write_model

    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "tiny.gguf"
    if not path.exists():
        write_model(path, "tiny", seed=0)
    return str(path)


def _spec_counts(url: str) -> tuple[float, float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = []
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        # Labelled (engine, model_name): the first sample of the family.
        line = next((ln for ln in text.splitlines() if ln.startswith(name + "{")), None)
        out.append(float(line.rsplit(" ", 1)[1]) if line else sample_value(text, name) or 0.0)
    return out[0], out[1], out[2]


def _step_cost(url: str) -> dict[int, float]:
    """What the engine measured a generation step's decode to cost, by rows (the draft rule's
    input): ``hydra_step_decode_seconds{rows="N"}``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    rows = {int(sample.labels["rows"]): sample.value
            for family in text_string_to_metric_families(text) if family.name == "hydra_step_decode_seconds"
            for sample in family.samples}
    return dict(sorted(rows.items()))


async def _one(c: httpx.AsyncClient, workload: str, seed: int, n: int, spec: dict[str, Any] | None) -> tuple[str, int]:
    body: dict[str, Any] = {"prompt": WORKLOADS[workload], "max_tokens": n, "temperature": 0, "seed": seed,
                            **SAMPLING.get(workload, {})}
    if spec is not None:
        body["speculative"] = spec
    r = await c.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text}")
    data = r.json()
    return data["choices"][0]["text"], data["usage"]["completion_tokens"]


async def _run(url: str, workload: str, streams: int, n: int, spec: dict[str, Any] | None) -> dict[str, Any]:
    """``streams`` concurrent copies of the workload: aggregate tok/s and the texts."""
    texts: list[str] = [""] * streams
    tokens = [0] * streams
    before = _spec_counts(url)
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:

        async def go(i: int) -> None:
            texts[i], tokens[i] = await _one(c, workload, 1000 + i, n, spec)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(go, i)
        wall = time.perf_counter() - t0
    after = _spec_counts(url)
    drafted, accepted = after[1] - before[1], after[2] - before[2]
    return {"tok_s": sum(tokens) / wall, "tokens": sum(tokens), "wall_s": wall, "texts": texts,
            "drafts": after[0] - before[0], "drafted": drafted, "accepted": accepted}


async def _bench(url: str, rounds: int, streams_list: list[int], n: int, workloads: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    print(f"{'round':>5} {'workload':>8} {'streams':>7} {'off tok/s':>9} {'spec tok/s':>10} {'ratio':>6} "
          f"{'accept':>7} {'drafted':>7} {'same':>5}")
    for rnd in range(1, rounds + 1):
        for workload in workloads:
            for streams in streams_list:
                # Both runs find the prompt in their slots (a one-token request first): the
                # figures compare generation, not who paid the prompt.
                await _run(url, workload, streams, 1, OFF)
                first, second = (OFF, None) if rnd % 2 else (None, OFF)  # None: the engine's --spec-type
                ran = {id(first): await _run(url, workload, streams, n, first)}
                ran[id(second)] = await _run(url, workload, streams, n, second)
                off, on = ran[id(OFF)], ran[id(None)]
                same = sum(a == b for a, b in zip(off["texts"], on["texts"], strict=True))
                rate = on["accepted"] / on["drafted"] if on["drafted"] else 0.0
                row = {"round": rnd, "workload": workload, "streams": streams, "off_tok_s": off["tok_s"],
                       "spec_tok_s": on["tok_s"], "ratio": on["tok_s"] / off["tok_s"], "acceptance": rate,
                       "drafted": on["drafted"], "accepted": on["accepted"], "drafts": on["drafts"],
                       "same_text": same, "tokens_off": off["tokens"], "tokens_spec": on["tokens"]}
                rows.append(row)
                print(f"{rnd:>5} {workload:>8} {streams:>7} {off['tok_s']:>9.1f} {on['tok_s']:>10.1f} "
                      f"{row['ratio']:>5.2f}x {rate:>6.0%} {int(on['drafted']):>7} {same:>2}/{streams}", flush=True)
    return rows


PEER_MODES = ("none", "ngram-simple", "ngram-mod")  # llama-server's --spec-type, each its own server


async def _peer_run(url: str, prompt: str, workload: str, streams: int, n: int) -> float:
    """``streams`` concurrent copies of the workload's prompt on llama-server's
    /v1/completions (the very prompt ours gets): aggregate tok/s."""
    tokens = [0] * streams
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:

        async def go(i: int) -> None:
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "seed": 1000 + i, **SAMPLING.get(workload, {})}
            r = await c.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"llama-server {r.status_code}: {r.text}")
            tokens[i] = r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(go, i)
        wall = time.perf_counter() - t0
    return sum(tokens) / wall


def peer_rows(
    binary: Path,
    model: str,
    prompts: dict[str, str],
    rounds: int,
    streams_list: list[int],
    n: int,
    threads: int,
    log_dir: Path,
) -> list[dict[str, Any]]:
    """llama-server on the same requests, plain and with each of its n-gram modes (each mode
    a server of its own: the flag is per server), every round printed."""
    from benchmarks.llama_server import LlamaServer

    rows: list[dict[str, Any]] = []
    slots = max(streams_list)
    for mode in PEER_MODES:
        extra = [] if mode == "none" else ["--spec-type", mode]
        with LlamaServer(binary, model, ctx=2048 * slots, slots=slots, log_dir=log_dir, tag=f"llama-server-{mode}",
                         threads=threads, extra=extra) as server:
            for rnd in range(1, rounds + 1):
                for workload, prompt in prompts.items():
                    for streams in streams_list:
                        trio.run(_peer_run, server.url, prompt, workload, streams, 1)  # prompt cached, as ours
                        rate = trio.run(_peer_run, server.url, prompt, workload, streams, n)
                        rows.append(
                            {"mode": mode, "round": rnd, "workload": workload, "streams": streams, "tok_s": rate}
                        )
                        print(f"llama-server --spec-type {mode:>12} round "
                              f"{rnd} {workload:>8} x{streams}: {rate:.1f} tok/s", flush=True)
    return rows


def check_logits(model: str, threads: int) -> None:
    """Whether one position's logits are the same evaluated alone and as the first of k+1
    positions of its sequence (the rest after it: causally invisible to it)."""
    import numpy as np

    from hydra_trio.engine.llama.context import LlamaBackend

    b = LlamaBackend(model, n_slots=1, n_ctx=2048, n_threads=threads, n_batch=512)
    try:
        prompt = b.tokenize(PASSAGE, add_special=True)
        p = len(prompt)
        for k in (1, 2, 4, 8, 16):
            b.clear_slot(0)
            b.eval_chunk(0, prompt, None)
            rows = []
            for extra in (0, k):
                b._decode_batch([(0, 42, p, True)] + [(0, 42 + j, p + 1 + j, True) for j in range(extra)], None)
                rows.append(b._logits(0).copy())
                _drop_cells(b, p)  # the slot's token list never held them
            one, many = rows
            same = "bit-exact" if np.array_equal(one, many) else f"max abs diff {float(np.abs(one - many).max()):.3g}"
            print(f"  k = {k:>2}: {same}, argmax {'same' if one.argmax() == many.argmax() else 'DIFFERS'}")
    finally:
        b.close()


def _drop_cells(b: Any, p: int) -> None:
    import llama_cpp

    llama_cpp.llama_memory_seq_rm(b._mem, 0, p, -1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speculative")
    ap.add_argument("--model", choices=("gemma", "tiny"), default="gemma")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", default="1,8", help="comma list of concurrent stream counts")
    ap.add_argument("--tokens", type=int, default=160, help="max_tokens per reply")
    ap.add_argument("--workloads", default="copy,edit,free", help="comma list of " + ", ".join(WORKLOADS))
    ap.add_argument("--spec-max-batch", type=int, default=None, help="the engine's --spec-max-batch (default: its own)")
    ap.add_argument("--draft-n-max", type=int, default=None, help="the engine's --spec-draft-n-max (default: its own)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hydra-trio" / "bench-models")
    ap.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    ap.add_argument("--check-logits", action="store_true", help="only compare a position's logits alone and in a batch")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="also run llama-server (none, ngram-simple, "
                    "ngram-mod) on the same requests")
    ap.add_argument("--with-llama-server", action="store_true", help="as --llama-server, building it once if needed")
    args = ap.parse_args(argv)
    if args.check_logits:
        print(f"{args.model}: one position alone vs first of k+1 positions")
        check_logits(_model(args.model, args.cache), args.threads)
        return 0
    streams_list = [int(s) for s in args.streams.split(",")]
    workloads = args.workloads.split(",")
    if not set(workloads) <= set(WORKLOADS):
        ap.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    extra = ["--spec-type", "ngram-simple"]
    if args.spec_max_batch is not None:
        extra += ["--spec-max-batch", str(args.spec_max_batch)]
    if args.draft_n_max is not None:
        extra += ["--spec-draft-n-max", str(args.draft_n_max)]
    model = _model(args.model, args.cache)
    slots = max(streams_list)
    engine = EngineProcess(model, slots=slots, ctx_size=2048 * slots, threads=args.threads, extra=extra)
    with tempfile.TemporaryDirectory() as logs:
        engine.start(Path(logs), "engine")
        try:
            rows = trio.run(_bench, engine.url, args.rounds, streams_list, args.tokens, workloads)
            step_cost = _step_cost(engine.url)
        except BaseException:
            assert engine.log_path is not None
            print(engine.log_path.read_text()[-4000:])  # the engine's side of a failure
            raise
        finally:
            engine.stop()
        from benchmarks.llama_server import find_or_build

        binary = find_or_build(args.llama_server, args.with_llama_server)
        prompts = {w: WORKLOADS[w] for w in workloads}
        peers = (
            peer_rows(binary, model, prompts, args.rounds, streams_list, args.tokens, args.threads, Path(logs))
            if binary
            else []
        )
    print("\nthe engine's measured "
          "step decode, ms by rows: " + ", ".join(f"{r}: {t * 1e3:.0f}" for r, t in step_cost.items()))
    print("median over rounds:")
    for workload in workloads:
        for streams in streams_list:
            mine = [r for r in rows if r["workload"] == workload and r["streams"] == streams]
            print(f"  {workload:>5} x{streams}: {statistics.median(r['off_tok_s'] for r in mine):.1f} -> "
                  f"{statistics.median(r['spec_tok_s'] for r in mine):.1f} tok/s "
                  f"({statistics.median(r['ratio'] for r in mine):.2f}x), acceptance "
                  f"{statistics.median(r['acceptance'] for r in mine):.0%}")
            theirs = {
                m: [
                    p["tok_s"]
                    for p in peers
                    if p["mode"] == m and p["workload"] == workload and p["streams"] == streams
                ]
                for m in PEER_MODES
            }
            if all(theirs.values()):
                spec = statistics.median(r["spec_tok_s"] for r in mine)
                best = max(statistics.median(v) for m, v in theirs.items() if m != "none")
                print("        llama-server " + ", ".join(f"{m} {statistics.median(v):.1f}" for m, v in theirs.items())
                      + f" tok/s; ours with speculation / its best n-gram mode {spec / best:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "env": env_info(),
                "args": {k: str(v) for k, v in vars(args).items()},
                "rows": rows,
                "llama_server": peers,
                "step_cost_s": step_cost,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
