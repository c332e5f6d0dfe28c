"""Same-host hand-offs through shared memory (--kv-shm-dir, handoff/shm.py): the decode engine
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
    stale = [tmp_path / f"hydra-kv-{os.getuid()}-{dead}-0badcafe-"
             f"{'A' * 22}", tmp_path / f"hydra-kv-{os.getuid()}-{dead}-0badcafe-probe"]
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
    from hydra_trio.handoff.shm import ShmArea, network_namespace, shares_folder

    fifo = tmp_path / f"hydra-kv-{os.getuid()}-1-0badcafe-probe"
    os.mkfifo(fifo)
    assert shares_folder({"probe": str(fifo), "token": "x"}) is False  # returns at once
    area = ShmArea.open(str(tmp_path))
    assert area is not None
    assert shares_folder(area.advertised()) is True
    link = tmp_path / f"hydra-kv-{os.getuid()}-2-0badcafe-probe"
    link.symlink_to(area.probe)
    assert shares_folder({"probe": str(link), "token": area.token}) is False
    # Another network namespace is another host, whatever folder it shares.
    assert area.advertised()["netns"] == network_namespace()
    assert shares_folder({**area.advertised(), "netns": "1:2"}) is False
    area.close()


async def test_25_bad_hand_offs_never_hold_more_than_the_bound(
    start_engine: Callable[..., Any], tiny_model_ctx: Path, tmp_path: Path
) -> None:
    """Issue 28, goal 2: the kv_transfer_params sent back with ``hydra.kv_bytes + 1`` (any
    HTTP client can) make the pull fail after the file was handed over. The folder never
    holds more than --kv-export-max-bytes, and nothing is left after the TTL."""
    probe_p = await start_engine(tiny_model_ctx, kv_shm_dir="")
    size = (await _export(probe_p))["hydra"]["kv_bytes"]
    bound = 2 * size + size // 2  # room for two exports
    p = await start_engine(tiny_model_ctx, kv_shm_dir=str(tmp_path), kv_export_max_bytes=bound, kv_export_ttl_s=3.0)
    d = await start_engine(tiny_model_ctx, kv_pull_timeout_s=0.2)
    for _ in range(25):
        params = await _export(p)
        params["hydra"]["kv_bytes"] += 1
        kv = (await _decode(d, params))["kv_transfer"]
        assert kv["status"] == "fallback", kv
        assert sum((tmp_path / name).stat().st_size for name in _ours(tmp_path)) <= bound
    await wait_until(lambda: _ours(tmp_path) == [] and p.state.exports.handed_bytes == 0)


def _plant(folder: Path, tag: str, *, probe: bool = True) -> list[Path]:
    files = [folder / f"{tag}-{'A' * 22}"] + ([folder / f"{tag}-probe"] if probe else [])
    for f in files:
        f.write_bytes(b"x")
    return files


def test_planted_and_foreign_files_never_stop_a_start(tmp_path: Path, monkeypatch: Any) -> None:
    """Issue 28, 1.2: the clean-up at start skips (and logs) what it cannot handle instead of
    aborting the start: a pid past every integer type, another user's file under this
    user's name, a link, a file it may not examine."""
    from hydra_trio.handoff import shm

    uid = os.getuid()
    huge = tmp_path / f"hydra-kv-{uid}-99999999999999999999-deadbeef-probe"  # OverflowError in os.kill
    huge.write_bytes(b"x")
    target = tmp_path / "not-ours"
    target.write_bytes(b"keep")
    link = tmp_path / f"hydra-kv-{uid}-1-0badcafe-{'L' * 22}"
    link.symlink_to(target)
    foreign = _plant(tmp_path, f"hydra-kv-{uid}-2-0badcafe")
    if uid == 0:
        for f in foreign:
            os.chown(f, 65534, 65534)
    else:  # seen as another user sees them: as if this process were uid + 1
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
        for f in foreign:
            f.rename(f.with_name(f.name.replace(f"-{uid}-", f"-{uid + 1}-")))
        foreign = [f.with_name(f.name.replace(f"-{uid}-", f"-{uid + 1}-")) for f in foreign]
    denied = _plant(tmp_path, f"hydra-kv-{os.getuid()}-3-0badcafe")
    real_lstat = os.lstat

    def lstat(path: Any, *a: Any, **k: Any) -> os.stat_result:
        if Path(path) in denied:
            raise PermissionError(13, "Permission denied", str(path))
        return real_lstat(path, *a, **k)

    monkeypatch.setattr(shm.os, "lstat", lstat)
    area = shm.ShmArea.open(str(tmp_path))
    assert area is not None  # started
    assert link.is_symlink() and target.read_bytes() == b"keep"
    assert all(f.exists() for f in foreign) and all(f.exists() for f in denied)
    area.close()


_HOLDER = """
import os, sys
from hydra_trio.handoff.shm import ShmArea
area = ShmArea.open(sys.argv[1])
export = area.probe.with_name(area.probe.name.replace("-probe", "-" + "E" * 22))
export.write_bytes(b"x")
print(area.probe.name, export.name, flush=True)
sys.stdin.read()
os._exit(0)  # the lock goes with the process, the files stay: a crash
"""


def test_liveness_is_the_owner_s_lock_not_its_pid(tmp_path: Path) -> None:
    """Files of an engine that holds its probe's lock are kept (in another process, which
    may be in another PID namespace), those of one that no longer does are removed, even
    when their pid is a running process's (a pid seen from another namespace)."""
    import subprocess
    import sys

    from hydra_trio.handoff.shm import ShmArea

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert holder.stdout is not None
        live = [tmp_path / name for name in holder.stdout.readline().split()]
        assert len(live) == 2
        unlocked = _plant(tmp_path, f"hydra-kv-{os.getuid()}-{os.getppid()}-0badcafe")  # a live pid, no lock
        orphan = _plant(tmp_path, f"hydra-kv-{os.getuid()}-{os.getpid()}-1badcafe", probe=False)  # no probe
        area = ShmArea.open(str(tmp_path))
        assert area is not None
        assert all(f.exists() for f in live)  # its engine runs
        assert not any(f.exists() for f in unlocked + orphan)
        area.close()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    area = ShmArea.open(str(tmp_path))  # the holder has gone (its files stayed)
    assert area is not None
    assert not any(f.exists() for f in live)
    area.close()
