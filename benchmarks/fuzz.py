"""``python -m benchmarks.fuzz``: the live RPC fuzz campaign (hydra_trio.testing.rpcfuzz,
shared with tests/rpc/test_fuzz_live.py) against its own ``hydra-trio serve`` process."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import trio

from hydra_trio.testing.process import EngineProcess
from hydra_trio.testing.rpcfuzz import FuzzReport, engine_health, run_campaign
from hydra_trio.testing.rpcfuzz import __doc__ as _CAMPAIGN_DOC

# ---- python -m benchmarks.fuzz ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from hydra_trio.model.synthetic import write_model

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fuzz", description=(_CAMPAIGN_DOC or "").split("\n\n")[0]
    )
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--minutes", type=float, default=10.0, help="stop after this long even if frames remain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hydra-fuzz-") as tmp:
        model = write_model(Path(tmp) / "tiny.gguf", "tiny", seed=0)
        engine = EngineProcess(str(model), slots=2, ctx_size=2048, threads=1, batch_size=64)
        engine.start(Path(tmp), "engine")
        try:
            report = trio.run(
                lambda: run_campaign(
                    engine.rpc_port,
                    engine.http_port,
                    frames=args.frames,
                    seed=args.seed,
                    time_limit_s=args.minutes * 60,
                )
            )
            alive = engine.proc is not None and engine.proc.poll() is None
            rss = engine.rss_bytes() if alive else 0
        finally:
            engine.stop()
            code = engine.proc.returncode if engine.proc is not None else None
            log_text = engine.log_path.read_text(errors="replace") if engine.log_path else ""
    result = report.as_dict()
    result["engine_alive_after"] = alive
    result["engine_exit_code"] = code
    result["engine_rss_mb_after"] = round(rss / 2**20, 1)
    result["tracebacks_in_log"] = log_text.count("Traceback")
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = report.findings == 0 and alive and code == 0 and result["tracebacks_in_log"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["FuzzReport", "engine_health", "run_campaign"]
