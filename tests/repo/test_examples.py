"""The examples a user runs first must keep working: run them against the tiny model."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

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


async def test_lm_eval_example_tasks_and_recording_proxy(start_engine: Any, tiny_model: Path, tmp_path: Path) -> None:
    """The lm-eval example's cheap parts without lm-eval: its task files are the YAML lm-eval
    reads (a local JSON dataset, one loglikelihood and one generation task), and its proxy
    forwards to the engine and records what passed."""
    import lm_eval_offline

    await trio.to_thread.run_sync(_check_task_files, tmp_path)
    ep = await start_engine(tiny_model)
    capture: list[dict[str, Any]] = []

    def through_proxy() -> tuple[int, dict[str, Any]]:
        with lm_eval_offline.recording_proxy(f"http://127.0.0.1:{ep.http_port}", capture) as base:
            info = httpx.get(base + "/tokenizer_info", timeout=30)
            r = httpx.post(base + "/tokenize", json={"prompt": "hello", "add_special_tokens": False}, timeout=30)
            return info.status_code, r.json()

    status, tokens = await trio.to_thread.run_sync(through_proxy)
    assert status == 200 and tokens["tokens"]
    assert capture == [
        {"method": "GET", "path": "/tokenizer_info", "body": None},
        {"method": "POST", "path": "/tokenize", "body": {"prompt": "hello", "add_special_tokens": False}},
    ]


def _check_task_files(folder: Path) -> None:
    import lm_eval_offline
    import yaml

    lm_eval_offline.write_tasks(folder)
    mc = yaml.safe_load((folder / "hydra_mc.yaml").read_text())
    gen = yaml.safe_load((folder / "hydra_gen.yaml").read_text())
    assert mc["output_type"] == "multiple_choice" and gen["output_type"] == "generate_until"
    data = Path(mc["dataset_kwargs"]["data_files"]["test"])
    assert [json.loads(line)["answer"] for line in data.read_text().splitlines()] == [
        d["answer"] for d in lm_eval_offline.DOCS
    ]
    assert gen["generation_kwargs"]["until"] == ["\n"]


@pytest.mark.slow
def test_lm_eval_example_completes() -> None:
    """The whole run, where lm-eval is installed (HYDRA_LM_EVAL names its lm_eval command,
    else the one on PATH): both tasks complete and report their metric."""
    import os
    import shutil
    import subprocess

    command = os.environ.get("HYDRA_LM_EVAL") or shutil.which("lm_eval")
    if not command:
        pytest.skip("lm-eval not installed (pip install 'lm-eval[api]'; HYDRA_LM_EVAL=PATH)")
    example = Path(__file__).resolve().parents[2] / "examples" / "lm_eval_offline.py"
    done = subprocess.run(
        [sys.executable, str(example), "--lm-eval", command], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert '"acc,none"' in done.stdout and '"exact_match,none"' in done.stdout
