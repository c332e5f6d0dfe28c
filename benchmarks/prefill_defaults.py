"""Are the defaults the fast ones on this CPU? (issue 43, item 2)

    python -m benchmarks.prefill_defaults [--tokens 4096] [--rounds 2] [--threads 1]

One prompt of ``--tokens`` random token ids, prefilled through the engine's own backend
(``LlamaBackend.eval_chunk``, no server) on the real model (Gemma 3 270M), with the default
settings and with each alternative a flag offers: ``--batch-size`` 1024 and 2048 (one ubatch
per chunk, so a cancel waits for a whole chunk), ``--flash-attn off``, ``--no-repack``. The
figure is the process's CPU seconds over the prefill (one llama thread: wall time on a quiet
machine, and barely moved by a busy one); rounds alternate the order. Prints each setting's
median and its ratio to the default; writes benchmarks/results/prefill-defaults.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from .harness import env_info

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefill_defaults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill-defaults.json")
    args = ap.parse_args(argv)

    import numpy as np

    from hydra_trio.engine.llama.context import LlamaBackend
    from hydra_trio.engine.llama.devices import OffloadSettings
    from hydra_trio.model.registry import named_model_path

    settings: dict[str, dict[str, Any]] = {
        "default (--batch-size 512, "
        "--flash-attn auto, repack by the CPU)": {"n_batch": 512, "offload": OffloadSettings()},
        "--batch-size 1024": {"n_batch": 1024, "offload": OffloadSettings()},
        "--batch-size 2048": {"n_batch": 2048, "offload": OffloadSettings()},
        "--flash-attn off": {"n_batch": 512, "offload": OffloadSettings(flash_attn="off")},
        "--no-repack": {"n_batch": 512, "offload": OffloadSettings(repack=False)},
    }
    model = str(named_model_path("gemma3-270m"))
    n = args.tokens
    rng = np.random.default_rng(0)
    cpu: dict[str, list[float]] = {k: [] for k in settings}
    for r in range(args.rounds):
        prompt = [2, *rng.integers(1000, 200_000, n - 1).tolist()]
        names = list(settings) if r % 2 == 0 else list(settings)[::-1]
        for name in names:
            backend = LlamaBackend(
                model, n_slots=2, n_ctx=2 * (n + 2048), n_threads=args.threads, kv_unified=False, **settings[name]
            )
            try:
                t0 = time.process_time()
                for i in range(0, n, backend.n_batch):
                    backend.eval_chunk(0, prompt[i : i + backend.n_batch], None, want_logits=i + backend.n_batch >= n)
                cpu[name].append(time.process_time() - t0)
            finally:
                backend.close()
            print(f"round {r}: {name}: {cpu[name][-1]:.2f} CPU s", flush=True)
    base = statistics.median(cpu[next(iter(settings))])
    rows = {
        k: {"cpu_s": v, "median": statistics.median(v), "ratio_to_default": statistics.median(v) / base}
        for k, v in cpu.items()
    }
    for k, row in rows.items():
        print(f"{k}: median {row['median']:.2f} CPU s, {row['ratio_to_default']:.3f}x the default")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"env": env_info(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
