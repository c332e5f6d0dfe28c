"""The live fuzz campaign (benchmarks/fuzz.py) at a CI budget: about 2,000 mutated and
hypothesis-drawn frames on persistent connections against an in-process engine, every reply
read; PREFILLs and accepted DECODEs run for real. No crash, hang, desync or resurrected entry,
and the engine is healthy afterwards. The full figure: `python -m benchmarks.fuzz`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fuzz import run_campaign

FRAMES = 2000


async def test_live_fuzz_campaign(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, log_level="WARNING")
    report = await run_campaign(ep.rpc_port, ep.http_port, frames=FRAMES, seed=1, time_limit_s=120, hang_s=30)
    summary = report.as_dict()
    assert report.frames == FRAMES, summary
    assert report.findings == 0, summary
    # The campaign reached the deep paths, not only the frame checks.
    assert report.outcomes["OK"] > 100, summary
    assert report.decodes_accepted > 20, summary
    assert report.by_source["hypothesis"] > 500 and report.by_source["mutation"] > 500, summary
    assert report.outcomes["closed"] > 0, summary  # bad magic was tried
    assert report.health["ok"], summary
