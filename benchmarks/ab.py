"""Two versions of hydra-trio side by side, round for round: the ceiling's streams (the synthetic
``tiny`` model, one llama thread) sent to each in turn, the order alternating, so that the
drift of a shared VM (seen here: a third either way within minutes) falls on both alike.

    python -m benchmarks.ab --base /path/to/other/checkout [--streams 1] [--rounds 25]
                            [--tokens 220] [--slots 128]

``--base`` is another checkout of the project (``git worktree add /tmp/base COMMIT``); its
``src`` goes first on the engine's PYTHONPATH. Printed: each version's median tok/s and CPU
per token, and the median, min and max of the per-round ratio (this checkout / base), the
figure to read when both run the same requests under the same noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .ceiling import measure, run_round
from .harness import EngineProcess, words_prompt

HERE = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (its src/ is used)")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--tokens", type=int, default=220)
    ap.add_argument("--slots", type=int, default=128)
    args = ap.parse_args(argv)
    if not (args.base / "src" / "hydra_trio").is_dir():
        ap.error(f"--base {args.base}: no src/hydra_trio there")
    from hydra_trio.model.synthetic import write_model

    work = Path(tempfile.mkdtemp(prefix="hydra-ab-"))
    model = work / "tiny.gguf"
    write_model(model, "tiny", seed=0)
    engines: dict[str, EngineProcess] = {}
    before = os.environ.get("PYTHONPATH")
    try:
        for name, src in (("base", args.base / "src"), ("this", HERE / "src")):
            os.environ["PYTHONPATH"] = str(src)  # the engine process imports this version
            engines[name] = EngineProcess(
                str(model), slots=args.slots, ctx_size=args.slots * 512, threads=1, batch_size=max(512, args.slots),
                extra=["--step-token-budget", str(max(32, args.slots))],
            ).start(work, name)
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        order = list(engines.items())
        for rnd in range(args.rounds + 1):  # round 0 warms both up, unmeasured
            prompts = [
                f"{chr(97 + (rnd + k) % 26)}{k} " + words_prompt(12, seed=1000 * rnd + k) for k in range(args.streams)
            ]
            for name, eng in order if rnd % 2 == 0 else order[::-1]:
                port = eng.http_port
                row = measure(
                    name,
                    port,
                    eng.pid,
                    eng.pid,
                    lambda port=port, prompts=prompts: run_round(port, prompts, args.tokens),
                )
                if rnd:
                    rows[name].append(row)
        for name, rs in rows.items():
            print(f"{name:5s} tok/s median {statistics.median(r['tok_s'] for r in rs):7.0f}, CPU per token "
                  f"{statistics.median(r['server_cpu_us_per_token'] for r in rs):5.0f} us (worker busy "
                  f"{statistics.median(r['worker_busy_us_per_token'] for r in rs):4.0f}, llama_decode "
                  f"{statistics.median(r['decode_us_per_token'] for r in rs):4.0f}, trio thread "
                  f"{statistics.median(r['trio_thread_cpu_us_per_token'] for r in rs):4.0f})")
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(rows["this"], rows["base"], strict=True)]
        print(f"this / base tok/s, per round: median {statistics.median(ratios):.3f}, min {min(ratios):.3f},"
              f" max {max(ratios):.3f} ({len(ratios)} rounds of {args.streams} streams x {args.tokens} tokens)")
    finally:
        for eng in engines.values():
            eng.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
