"""The command line: make-model/identity, and the client commands against a live engine."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import trio

from hydra_trio import cli


def test_make_model_with_metadata_and_identity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.gguf"
    assert (
        cli.main(
            [
                "make-model",
                str(out),
                "--name",
                "CodeLlama Tiny",
                "--tag",
                "reasoning",
                "--kv",
                "llama.nextn_predict_layers=1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert cli.main(["identity", str(out), "--alias", "x"]) == 0
    ident = json.loads(capsys.readouterr().out)
    assert ident["model_name"] == "CodeLlama Tiny"
    assert ident["model_alias"] == "x"
    assert set(ident["model_capabilities_names"]) == {"MTP", "REASONING", "CODE"}
    assert ident["model_hash"] == hashlib.sha256(out.read_bytes()).hexdigest()


def test_settings_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["settings"]) == 0
    table = capsys.readouterr().out
    assert "`--decode-result-ttl-s` | `HYDRA_DECODE_RESULT_TTL_S`" in table


async def test_client_commands_against_a_live_engine(
    engine: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rpc = f"127.0.0.1:{engine.rpc_port}"
    http = f"http://127.0.0.1:{engine.http_port}"

    async def run(*argv: str) -> dict[str, Any]:
        rc = await trio.to_thread.run_sync(cli.main, list(argv))
        out = capsys.readouterr().out
        assert rc == 0, out
        return json.loads(out)

    info = await run("info", "--rpc", rpc)
    assert "merged_decode" in info["capabilities"]
    blob = tmp_path / "kv.blob"
    meta = await run("prefill", "hello there", "--rpc", rpc, "--slot", "0", "--out", str(blob), "--max-tokens", "5")
    assert blob.stat().st_size == meta["blob_bytes"] > 0
    meta_file = tmp_path / "meta.json"
    meta_file.write_text(json.dumps(meta))
    ack = await run(
        "decode",
        "hello there",
        "--rpc",
        rpc,
        "--slot",
        "1",
        "--kv",
        str(blob),
        "--kv-meta",
        str(meta_file),
        "--max-tokens",
        "5",
    )
    assert ack["valid"] is True and ack["n_past_after_restore"] == meta["n_past"]
    result = await run("result", str(ack["decode_request_id"]), "--http", http)
    assert result["usage"]["completion_tokens"] == 5
    assert result["hydra_metrics"]["logits_reused"] is True
    deleted = await run("cancel", str(ack["decode_request_id"]), "--http", http)
    assert deleted["state"] == "deleted"


def test_settings_llama_cpp_would_abort_on_are_refused_naming_the_flags() -> None:
    """--slots above --batch-size made llama.cpp abort the process (GGML_ASSERT n_outputs_max)
    at context creation; now the settings are refused first, with both flags named."""
    from hydra_trio.config import settings_from

    with pytest.raises(SystemExit, match=r"slots \(40\) must not exceed batch_size \(16\).*--slots, --batch-size"):
        settings_from(None, env={}, slots=40, batch_size=16)
    with pytest.raises(SystemExit, match="fewer than 16 cells with a split KV cache"):
        settings_from(None, env={}, slots=8, ctx_size=64)
    assert settings_from(None, env={}, slots=8, ctx_size=64, kv_unified=True).kv_unified
    for bad in ({"stream_interval": 0}, {"slot_prompt_similarity": 1.5}, {"cache_ram_mib": -1}):
        with pytest.raises(SystemExit, match="invalid settings"):
            settings_from(None, env={}, **bad)
    # No slots is a range's problem, named, not a division by zero in the split-cache rule.
    with pytest.raises(SystemExit, match=r"slots must be 1\.\.256"):
        settings_from(None, env={}, slots=0)


def test_version_and_a_dead_engine_are_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    from hydra_trio import __version__
    from hydra_trio.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"hydra-trio {__version__}"
    for argv in (["info", "--rpc", "127.0.0.1:1"], ["result", "5", "--http", "http://127.0.0.1:1"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "cannot reach the engine at" in err and "Traceback" not in err and len(err.splitlines()) == 1
