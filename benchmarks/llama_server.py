"""llama.cpp's own C++ server as a benchmark peer.

`python -m benchmarks --with-llama-server` builds `llama-server` once from the sdist of the
installed llama-cpp-python version (its vendored llama.cpp, the same code our engine runs),
into the user cache; `--llama-server PATH` uses an existing binary instead. Building takes
about 10 minutes on 2 cores; a missing peer is skipped with a message, never a crash.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from hydra_trio.testing.sse_reader import sse_chunk

from .harness import free_port, summary, wait_http

CACHE = Path.home() / ".cache" / "hydra-trio" / "llama-server-build"


def cached_binary(llama_cpp_version: str) -> Path:
    return CACHE / f"llama_cpp_python-{llama_cpp_version}" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"


def find_or_build(path: str | None, build: bool) -> Path | None:
    """The llama-server binary to compare against, or None (with the reason printed)."""
    if path:
        binary = Path(path)
        if binary.is_file():
            return binary
        print(f"--llama-server {path}: no such file; skipping the llama-server comparisons")
        return None
    ver = version("llama-cpp-python")
    binary = cached_binary(ver)
    if binary.is_file():
        return binary
    if not build:
        print("llama-server not given (--llama-server PATH or --with-llama-server): skipping those comparisons")
        return None
    try:
        return _build(ver)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"building llama-server failed ({exc}); skipping the llama-server comparisons")
        return None


def sdist_tree(ver: str) -> Path:
    """The extracted sdist of llama-cpp-python ``ver`` under CACHE (downloaded once)."""
    src = CACHE / f"llama_cpp_python-{ver}"
    if (src / "PKG-INFO").is_file():
        return src
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading the llama-cpp-python {ver} sdist ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={ver}", "-d", tmp],
            check=True,
        )
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    return src


def _build(ver: str) -> Path:
    if shutil.which("cmake") is None:
        raise OSError("cmake not found")
    root = sdist_tree(ver) / "vendor" / "llama.cpp"
    print("building llama-server (about 10 minutes on 2 cores, once) ...", flush=True)
    subprocess.run(
        ["cmake", "-B", "build", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"],
        cwd=root, check=True, stdout=subprocess.DEVNULL,
    )
    # A job per core: a bare -j starts every compile at once (a load of ~90 and 11 GiB on 2 cores).
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", "build", "--target", "llama-server", "-j", jobs],
        cwd=root,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return cached_binary(ver)


class LlamaServer:
    """One llama-server process on loopback: ``slots`` parallel slots sharing ``ctx`` cells,
    2 threads like our engines, slot files under ``slot_dir``."""

    def __init__(
        self, binary: Path, model: str, *, ctx: int, slots: int, log_dir: Path, tag: str, threads: int = 2,
        extra: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.slot_dir = Path(tempfile.mkdtemp(prefix="llama-server-slots-"))
        self._log = open(log_dir / f"{tag}.log", "wb")
        self.proc = subprocess.Popen(
            [str(binary), "-m", model, "-c", str(ctx), "-np", str(slots), "-t", str(threads), "-tb", str(threads),
             "--host", "127.0.0.1", "--port", str(self.port), "--slot-save-path", str(self.slot_dir),
             "--no-warmup", *extra],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        wait_http(self.url + "/health", self.proc, timeout=300)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        self._log.close()
        shutil.rmtree(self.slot_dir, ignore_errors=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def slot_restore_ttft_ms(server: LlamaServer, prompt: str, repeats: int) -> dict[str, Any]:
    """llama-server's local hand-off: prefill ``prompt`` into slot 0, save the slot to a file,
    erase it; then (timed) restore the file and stream until the first token."""
    times: list[float] = []
    n_prompt = 0
    # No keep-alive: llama-server may close a connection after a streamed response.
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=server.url, timeout=600, limits=no_reuse) as http:
        for i in range(repeats):
            body = {"prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True, "temperature": 0}
            r = http.post("/completion", json=body)
            r.raise_for_status()
            n_prompt = r.json()["tokens_evaluated"]
            name = f"bench-{i}.bin"
            http.post("/slots/0", params={"action": "save"}, json={"filename": name}).raise_for_status()
            http.post("/slots/0", params={"action": "erase"}).raise_for_status()
            t0 = time.perf_counter()
            http.post("/slots/0", params={"action": "restore"}, json={"filename": name}).raise_for_status()
            with http.stream("POST", "/completion", json={**body, "n_predict": 4, "stream": True}) as resp:
                first = None
                for line in resp.iter_lines():
                    if first is None and (chunk := sse_chunk(line)) is not None and chunk.get("content"):
                        first = time.perf_counter()
            if first is None:
                raise RuntimeError("llama-server streamed no text")
            times.append((first - t0) * 1000.0)
            http.post("/slots/0", params={"action": "erase"}).raise_for_status()
    return {"n_prompt": n_prompt, "ttft_ms": summary(times)}
