"""`python -m benchmarks.spec_replay [--model gemma|tiny] [--tokens N] [--streams 1,8]
[--draft-n-max N] [--priors 0.4,0.6,0.8,0.95] [--out PATH]`

The draft policy replayed on real replies, without the model in the loop: how the engine's
own drafting code (engine/speculation/drafter.py: ``Speculation.candidate`` and ``plan_drafts``)
would do on the workloads of ``benchmarks.speculative``, priced at the pass costs measured
here. The policy's constants were chosen this way; a run takes about two minutes.

1. Measures ``llama_decode`` of one sequence by rows (1..40, then 48 to 256; median of 3),
   the table the engine learns as it runs (``StepCost``).
2. Generates each workload's reply one token at a time (greedy; "sampled" at temperature 1,
   top-k 40, top-p 0.95, two seeds): the text a request produces without speculation.
3. Replays each reply as the engine would generate it with speculation: at every step each
   stream offers its candidate, the plan picks the draft lengths, the accepted prefix is what
   the reply itself continues with (a greedy pick, or a seeded draw, is the same with or
   without a draft), and the step costs its passes (``ubatch_rows``) from the table; 8
   streams are 8 copies of the reply in 8 consecutive slots of a split cache.

Printed: tok/s predicted without and with speculation, their ratio, drafted and accepted
tokens. What it leaves out: the first decode of each new batch shape (llama.cpp sizes its
buffers; the engine does not count it) and the Python around a step (about 1.5 ms a step is
added), and a real reply can differ from the replayed one where a verified position rounds
otherwise than a one-token step (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import env_info
from benchmarks.speculative import SAMPLING, WORKLOADS, _model
from hydra_trio.engine.speculation import SpecConfig, Speculation
from hydra_trio.engine.speculation import drafter as speculative
from hydra_trio.engine.speculation.policy import step_drafts, verify
from hydra_trio.engine.speculation.stepcost import BatchCost, StepCost, batch_counts

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = [*range(1, 41), 48, 64, 96, 128, 192, 256]
STEP_OVERHEAD_S = 0.0015  # the Python around a step: sampling each row, the hand-over
N_UBATCH = 512


def measure_costs(backend: Any) -> dict[int, float]:
    """Seconds of a llama_decode of n positions of one sequence (all with logits), by n."""
    import llama_cpp

    prompt = backend.tokenize(" ".join(["the lighthouse keeper wrote the weather"] * 30), add_special=True)[:200]
    backend.clear_slot(0)
    backend.eval_chunk(0, prompt, None)
    p = len(prompt)
    runs: dict[int, list[float]] = {n: [] for n in SIZES}
    for rep in range(4):
        for n in SIZES:
            t = time.perf_counter()
            backend._decode_batch([(0, 7 + j % 50, p + j, True) for j in range(n)], None)
            if rep:  # the first run of a shape also sizes llama.cpp's buffers
                runs[n].append(time.perf_counter() - t)
            llama_cpp.llama_memory_seq_rm(backend._mem, 0, p, -1)
    return {n: statistics.median(v) for n, v in runs.items()}


def reply(backend: Any, prompt: str, n: int, rng: np.random.Generator | None) -> tuple[list[int], list[int]]:
    """The prompt's tokens and its reply of up to ``n`` tokens, one token per decode."""
    backend.clear_slot(0)
    tokens = backend.tokenize(prompt, add_special=True)
    last = len(tokens) - 1
    backend._decode_batch([(0, t, i, i == last) for i, t in enumerate(tokens)], None)
    out: list[int] = []
    logits = backend._logits(last)
    while len(out) < n:
        tok = _pick(logits, rng)
        out.append(tok)
        if backend.is_eog(tok):
            break
        backend._decode_batch([(0, tok, len(tokens) + len(out) - 1, True)], None)
        logits = backend._logits(0)
    return tokens, out


def _pick(logits: np.ndarray, rng: np.random.Generator | None) -> int:
    if rng is None:
        return int(logits.argmax())
    s = SAMPLING["sampled"]
    top = np.argpartition(-logits, s["top_k"])[: s["top_k"]]
    top = top[np.argsort(-logits[top])]
    p = np.exp((logits[top] - logits[top[0]]).astype(np.float64) / s["temperature"])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), s["top_p"])) + 1
    return int(rng.choice(top[:keep], p=p[:keep] / p[:keep].sum()))


def replay(
    prompt: list[int], out: list[int], streams: int, table: dict[int, float], spec: SpecConfig | None
) -> dict[str, float]:
    """``streams`` copies of a reply generated with (or without) speculation: predicted tok/s
    (the steps priced from ``table`` as the engine prices them: between sizes, on the line)."""
    cost = StepCost()
    for rows, s in sorted(table.items()):
        cost.add(rows, s)
        cost.add(rows, s)
    priced = BatchCost(cost, N_UBATCH, split=True)  # a split cache: what the engine's 8 slots use
    state = [{"history": list(prompt), "at": 0, "spec": Speculation(spec) if spec else None} for _ in range(streams)]
    seconds = 0.0
    drafted = accepted = 0
    while True:
        live = [s for s in state if s["at"] < len(out) - 1]
        if not live:
            break
        slots = list(range(len(live)))  # consecutive slots, as the engine's slot choice packs them
        # The engine's own step: its candidates and plan (room: the tokens left after this step's).
        drafts = step_drafts(slots, [(s["spec"], s["history"], out[s["at"]], len(out) - 2 - s["at"]) for s in live],
                             priced, N_UBATCH - len(live))
        seconds += sum(
            cost.estimate(rows) or 0.0 for rows in priced.passes(batch_counts(slots, [1 + len(d) for d in drafts]))
        )
        seconds += STEP_OVERHEAD_S
        for s, draft in zip(live, drafts, strict=True):
            # A pick is the reply's next token, whatever the draft: the engine's accept rule on it.
            picks = verify(draft, lambda j, at=s["at"]: out[at + 1 + j], lambda _t: False)
            m = len(picks) - 1
            if draft:
                s["spec"].record(len(draft), m)
            drafted += len(draft)
            accepted += m
            s["history"].append(out[s["at"]])
            s["history"].extend(draft[:m])
            s["at"] += 1 + m
    return {"tok_s": streams * len(out) / seconds, "drafted": drafted, "accepted": accepted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.spec_replay")
    ap.add_argument("--model", choices=("gemma", "tiny"), default="gemma")
    ap.add_argument("--tokens", type=int, default=160, help="reply length (max_tokens)")
    ap.add_argument("--streams", default="1,8", help="comma list of concurrent copies")
    ap.add_argument("--draft-n-max", type=int, default=SpecConfig().n_max, help="drafted tokens per step at most")
    ap.add_argument("--priors", default=None, help="PRIOR_SURVIVAL to replay instead of the engine's, e.g. "
                    "0.4,0.6,0.8,0.95")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hydra-trio" / "bench-models")
    ap.add_argument("--out", type=Path, default=RESULTS / "spec-replay.json")
    args = ap.parse_args(argv)
    if args.priors:
        speculative.PRIOR_SURVIVAL = tuple(float(x) for x in args.priors.split(","))
    from hydra_trio.engine.llama.context import LlamaBackend

    backend = LlamaBackend(_model(args.model, args.cache), n_slots=1, n_ctx=4096, n_threads=1, n_batch=N_UBATCH)
    try:
        table = measure_costs(backend)
        print("pass ms by rows: " + ", ".join(f"{r}: {s * 1e3:.0f}" for r, s in table.items()), flush=True)
        replies: dict[str, tuple[list[int], list[int]]] = {}
        for workload, prompt in WORKLOADS.items():
            if workload == "sampled":
                for seed in (1, 2):
                    replies[f"sampled-{seed}"] = reply(backend, prompt, args.tokens, np.random.default_rng(seed))
            else:
                replies[workload] = reply(backend, prompt, args.tokens, None)
    finally:
        backend.close()
    rows: list[dict[str, Any]] = []
    print(f"{'workload':>10} {'streams':>7} {'off tok/s':>9} {'spec tok/s':>10} {'ratio':>6} {'drafted':>7} "
          f"{'accepted':>8}")
    for streams in (int(s) for s in args.streams.split(",")):
        for name, (prompt_tokens, out) in replies.items():
            off = replay(prompt_tokens, out, streams, table, spec=None)
            on = replay(prompt_tokens, out, streams, table, spec=SpecConfig(n_max=args.draft_n_max))
            row = {"workload": name, "streams": streams, "off_tok_s": off["tok_s"], "spec_tok_s": on["tok_s"],
                   "ratio": on["tok_s"] / off["tok_s"], "drafted": on["drafted"], "accepted": on["accepted"]}
            rows.append(row)
            print(f"{name:>10} {streams:>7} {off['tok_s']:>9.1f} {on['tok_s']:>10.1f} {row['ratio']:>5.2f}x "
                  f"{on['drafted']:>7} {on['accepted']:>8}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "env": env_info(),
                "args": {k: str(v) for k, v in vars(args).items()},
                "pass_s": table,
                "prior_survival": speculative.PRIOR_SURVIVAL,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
