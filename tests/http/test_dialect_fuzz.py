"""The dialects' routes fuzzed from their schemas (hydra_trio.testing.dialectfuzz, issue 50):
any JSON value in any field of a valid chat, Messages, count_tokens, Responses or
input_tokens body gets a 2xx or an error in its API's own shape, never a 5xx; every stream
ends with its end or its error event. A bounded, derandomized number of cases here (seeded);
``python -m benchmarks.dialect_fuzz --cases 20000`` runs the issue's 20,000 a route.

No 5xx is exempt: a schema bound past what llguidance reads (the former converter's
OverflowError) is the schema policy's to relax, or a 400 with strict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra_trio.testing.dialectfuzz import CORPUS, run_fuzz

CASES_PER_ROUTE = 60


async def test_any_value_in_any_field_is_a_well_formed_reply(start_engine: Any, tiny_model: Path) -> None:
    ep = await start_engine(tiny_model, slots=4, ctx_size=2048)  # 512 positions a slot: a fuzzed max_tokens stays short
    report = await run_fuzz(ep.http_port, cases_per_route=CASES_PER_ROUTE, seed=50, concurrency=1)
    assert sum(report.cases.values()) == 5 * CASES_PER_ROUTE + len(CORPUS)
    assert report.findings == {}, report.as_dict()
    # Every route answered both ways: the cases reach the codecs, not only their first check.
    statuses = report.as_dict()["by_route_and_status"]
    for route in report.cases:
        assert any(k.startswith(f"{route} 2") for k in statuses), statuses
        assert any(k.startswith(f"{route} 4") for k in statuses), statuses
