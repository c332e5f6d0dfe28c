"""``python -m benchmarks.hostile [--duration-s 60] [--short] [--seed 0] [--json PATH]``: the
hostile-client campaign (hydra_trio.testing.hostile, shared with tests/system/test_hostile_short.py;
what it runs and reports is that package's doc). Writes benchmarks/results/hostile.json
(``--short``: hostile-short.json)."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra_trio.testing.hostile import SHORT, Config, campaign, main, render

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS", "SHORT", "Config", "campaign", "main", "render"]

if __name__ == "__main__":
    sys.exit(main(results=RESULTS))
