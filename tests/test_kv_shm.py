"""Same-host hand-offs through shared memory (--kv-shm-dir, decode/shm.py): the decode engine
maps the prefill engine's export file instead of receiving its bytes over TCP, only when it
can read the prefill engine's probe; nothing is left in the folder afterwards."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from helpers import MESSAGES, http, wait_until

N = 8
PD = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
      "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
REQ = {"messages": MESSAGES, "max_tokens": N, "temperature": 0}


async def _export(p: Any) -> dict[str, Any]:
    async with http(p) as h:
        r = await h.post("/v1/chat/completions", json={**REQ, "max_tokens": 1, "kv_transfer_params": PD})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


async def _decode(d: Any, params: dict[str, Any]) -> dict[str, Any]:
    async with http(d) as h:
        r = await h.post("/v1/chat/completions", json={**REQ, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def _ours(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("hydra-kv-") and not p.name.endswith("-probe"))


async def test_a_same_host_hand_off_maps_the_export_and_leaves_nothing(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, tmp_path: Path
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    p = await start_engine(tiny_model_ctx, kv_shm_dir=str(shm))
    tcp_p = await start_engine(tiny_model_ctx, kv_shm_dir="")  # exports in process memory
    d = await start_engine(tiny_model_ctx)
    params = await _export(p)
    assert "shm" in params["hydra"]
    assert len(_ours(shm)) == 1  # the export's file
    via_shm = await _decode(d, params)
    assert via_shm["kv_transfer"]["status"] == "restored"
    assert via_shm["kv_transfer"]["transport"] == "shm"
    assert _ours(shm) == []  # unlinked once mapped
    via_tcp = await _decode(d, await _export(tcp_p))
    assert via_tcp["kv_transfer"]["transport"] == "tcp"
    # The same restore, the same first-token logits: the same greedy text either way.
    assert via_shm["choices"][0]["message"]["content"] == via_tcp["choices"][0]["message"]["content"]


async def test_without_the_probe_the_bytes_go_over_tcp(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, tmp_path: Path
) -> None:
    """A decode engine that cannot read the probe (another host, a container with its own
    /dev/shm: here, the probe announced with another token) pulls over TCP."""
    p = await start_engine(tiny_model_ctx, kv_shm_dir=str(tmp_path))
    d = await start_engine(tiny_model_ctx)
    params = await _export(p)
    params["hydra"]["shm"]["token"] = "not-the-probe-contents"
    body = await _decode(d, params)
    assert body["kv_transfer"]["status"] == "restored" and body["kv_transfer"]["transport"] == "tcp"
    assert _ours(tmp_path) == []  # sent, then unlinked


async def test_expired_exports_and_a_crashed_engine_s_files_are_removed(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, tmp_path: Path
) -> None:
    # What a crashed engine (a process that no longer runs) left behind.
    dead = 2**22 + 12345  # above the default pid_max: no process has it
    stale = [tmp_path / f"hydra-kv-{os.getuid()}-{dead}-0badcafe-{'A' * 22}", tmp_path / f"hydra-kv-{os.getuid()}-{dead}-0badcafe-probe"]
    for f in stale:
        f.write_bytes(b"x")
    other_user = tmp_path / f"hydra-kv-{os.getuid() + 1}-{dead}-0badcafe-{'B' * 22}"
    other_user.write_bytes(b"x")
    p = await start_engine(tiny_model_ctx, kv_shm_dir=str(tmp_path), kv_export_ttl_s=0.2)
    assert not any(f.exists() for f in stale) and other_user.exists()
    await _export(p)
    assert len(_ours(tmp_path)) == 2  # the export, and the other user's file
    exports = p.state.exports
    with trio.fail_after(10):
        while len(exports):
            await exports.wait_changed()
    await wait_until(lambda: _ours(tmp_path) == [other_user.name])


def test_a_probe_path_from_a_request_is_never_a_fifo_or_a_link(tmp_path: Path) -> None:
    """kv_transfer_params name the probe: a FIFO there must not block the engine (it would,
    opened plainly, until someone wrote to it), and a link must not be followed."""
    from hydra_trio.decode.shm import ShmArea, shares_folder

    fifo = tmp_path / f"hydra-kv-{os.getuid()}-1-0badcafe-probe"
    os.mkfifo(fifo)
    assert shares_folder({"probe": str(fifo), "token": "x"}) is False  # returns at once
    area = ShmArea.open(str(tmp_path))
    assert area is not None
    assert shares_folder(area.advertised()) is True
    link = tmp_path / f"hydra-kv-{os.getuid()}-2-0badcafe-probe"
    link.symlink_to(area.probe)
    assert shares_folder({"probe": str(link), "token": area.token}) is False
    area.close()
