"""What a step costs llama.cpp by where its streams sit among the configured slots.

    python -m benchmarks.slot_gaps [--streams 64] [--steps 150] [--reps 3]

The bare backend (no trio, no HTTP), the synthetic ``tiny`` model on one thread: ``--streams``
slots each hold an 8-token prompt, then ``--steps`` generation steps over all of them, timed
as llama_decode µs per token. The same streams on slots 0..n-1 of a table of n and of 2n,
on every other slot of 2n, and on a random n of 2n, with a split KV cache (a stream per
slot) and a unified one (``--kv-unified``). A split cache puts only consecutive sequence
ids into one ubatch, each ubatch a forward pass, so the gaps between busy slots, not the
configured slots, set the step's cost: what the slot choice (engine/slots.py, ``compact``)
keeps down.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.slot_gaps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)

    from hydra_trio.engine.llama.context import LlamaBackend
    from hydra_trio.engine.llama.types import StepRequest
    from hydra_trio.engine.params import SamplingParams
    from hydra_trio.engine.sample import Sampler
    from hydra_trio.model.synthetic import write_model

    model = Path(tempfile.mkdtemp(prefix="hydra-gaps-")) / "tiny.gguf"
    write_model(model, "tiny", seed=0)
    n = args.streams
    rng = random.Random(1)
    layouts = [
        (n, f"0..{n - 1}", list(range(n))),
        (2 * n, f"0..{n - 1}", list(range(n))),
        (2 * n, "every other", list(range(0, 2 * n, 2))),
        (2 * n, f"random {n}", sorted(rng.sample(range(2 * n), n))),
    ]

    def run(n_slots: int, active: list[int], unified: bool) -> tuple[float, float]:
        b = LlamaBackend(
            str(model), n_slots=n_slots, n_ctx=n_slots * 512, n_threads=1, n_batch=max(512, n_slots), kv_unified=unified
        )
        try:
            samplers = {s: Sampler(SamplingParams(temperature=0.0, ignore_eos=True)) for s in active}
            toks = {s: b.eval_chunk(s, list(range(5, 13)), None, sampler=samplers[s])[0] for s in active}
            b.decode_s = 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                res = b.step([StepRequest(s, toks[s], samplers[s]) for s in active])
                toks = dict(zip(active, res, strict=True))
            per = args.steps * len(active)
            return (time.perf_counter() - t0) * 1e6 / per, b.decode_s * 1e6 / per
        finally:
            for s in samplers.values():
                b.retire(s)
            b.close()

    print(f"{n} streams, {args.steps} steps, median of {args.reps}; llama_decode / whole step, us per token")
    for unified in (False, True):
        for n_slots, label, active in layouts:
            runs = [run(n_slots, active, unified) for _ in range(args.reps)]
            step, dec = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            every = ", ".join(f"{r[1]:.0f}" for r in runs)
            print(f"{'unified' if unified else 'split':8s} slots {n_slots:4d} busy {label:12s}: llama_decode "
                  f"{dec:6.1f} (runs {every}), step {step:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
