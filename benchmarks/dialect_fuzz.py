"""``python -m benchmarks.dialect_fuzz [--cases 20000] [--seed 0] [--json PATH]``: the dialects'
routes fuzzed from their schemas (hydra_trio.testing.dialectfuzz, issue 50), ``--cases`` a
route, against its own ``hydra-trio serve`` process (tiny synthetic model, 4 slots of 512
positions: a fuzzed ``max_tokens`` generates at most that). Every reply must be a 2xx or an
error in its API's own shape (never a 5xx), every stream end with its end or its error event.
The engine's tracebacks are counted by the file of their innermost frame of ours.
Writes benchmarks/results/dialect-fuzz.json; exits 1 on any finding or traceback."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import trio

from hydra_trio.testing.dialectfuzz import run_fuzz
from hydra_trio.testing.process import EngineProcess

RESULTS = Path(__file__).resolve().parent / "results"


def tracebacks(log_text: str) -> dict[str, int]:
    """The engine's tracebacks by the file of their innermost hydra_trio frame."""
    out: dict[str, int] = {}
    for block in log_text.split("Traceback (most recent call last):")[1:]:
        frames = re.findall(r'File "[^"]*/hydra_trio/([^"]+)"', block.split("\n\n")[0])
        where = frames[-1] if frames else "outside hydra_trio"
        out[where] = out.get(where, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dialect_fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=20000, help="cases a route")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=120.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from hydra_trio.model.synthetic import write_model

    with tempfile.TemporaryDirectory(prefix="hydra-dialect-fuzz-") as tmp:
        model = write_model(Path(tmp) / "tiny.gguf", "tiny", seed=0)
        engine = EngineProcess(
            str(model), slots=4, ctx_size=2048, threads=1, batch_size=64, extra=("--slot-wait-s", "30")
        )
        engine.start(Path(tmp), "engine")
        try:
            report = trio.run(lambda: run_fuzz(engine.http_port, cases_per_route=args.cases, seed=args.seed,
                                               concurrency=args.concurrency, time_limit_s=args.minutes * 60))
            alive = engine.proc is not None and engine.proc.poll() is None
        finally:
            engine.stop()
        log_text = engine.log_path.read_text(errors="replace") if engine.log_path else ""
    found = tracebacks(log_text)
    out = report.as_dict()
    out.update(engine_alive_at_end=alive, engine_exit_code=engine.proc.returncode if engine.proc else None,
               tracebacks_by_innermost_file=found)
    out["clean"] = alive and not out["findings"] and not found
    path = args.json or RESULTS / "dialect-fuzz.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    if found:  # the tracebacks themselves, beside the report (the engine's folder is gone)
        log_copy = path.with_suffix(".engine.log")
        log_copy.write_text(log_text)
        print(f"engine log with the tracebacks: {log_copy}")
    print(json.dumps({k: out[k] for k in ("cases", "total", "findings", "tracebacks_by_innermost_file", "elapsed_s",
                                          "clean")}, indent=2))
    print(f"report: {path}")
    return 0 if out["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
