"""The examples a user runs first must keep working: run them against the tiny model."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import cancel
import pd_handoff


async def test_pd_handoff_example(tiny_model: Path) -> None:
    out = io.StringIO()
    args = argparse.Namespace(a=None, b=None, model=str(tiny_model), slot=0, max_tokens=12)
    result = await pd_handoff.handoff(args, out)
    text = out.getvalue()
    assert "A: PREFILL" in text and "B: DECODE acked" in text and "hand-off:" in text
    m = result["hydra_metrics"]
    assert m["logits_reused"] is True
    assert m["n_common"] > 0 and m["kv_bytes"] > 0
    assert result["usage"]["completion_tokens"] == 12
    assert result["text"]


async def test_cancel_example(tiny_model: Path) -> None:
    out = io.StringIO()
    args = argparse.Namespace(e=None, model=str(tiny_model), slot=0, max_tokens=1500, after=5)
    result = await cancel.cancel_demo(args, out)
    assert result["delete_status"] == 200
    assert result["delete"]["cancelled"] is True and result["delete"]["state"] == "cancelled"
    assert result["get_status"] == httpx.codes.GONE
    assert result["slot_busy"] is False
