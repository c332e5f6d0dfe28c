"""`hydra-trio serve` as a subprocess on loopback (as in production: no shared GIL with the
driver), for the benchmarks and the campaigns the tests run."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .net import free_port


@dataclass
class EngineProcess:
    """`hydra-trio serve` in its own process (as in production: no shared GIL with the
    benchmark driver)."""

    model: str
    slots: int = 4
    ctx_size: int = 8192
    threads: int = 2
    batch_size: int = 512
    extra: Sequence[str] = ()
    http_port: int = field(default_factory=free_port)
    rpc_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    env: Mapping[str, str] | None = None  # the process's environment (None: this one's)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, log_dir: Path, name: str) -> EngineProcess:
        self.log_path = log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "hydra_trio.cli", "serve",
            "--model", self.model,
            "--port", str(self.http_port), "--rpc-port", str(self.rpc_port),
            "--slots", str(self.slots), "--ctx-size", str(self.ctx_size),
            "--threads", str(self.threads), "--batch-size", str(self.batch_size),
            "--default-n-predict", "64", "--log-level", "WARNING",
            *self.extra,
        ]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        wait_http(self.url + "/health", self.proc, timeout=300)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss_bytes(self) -> int:
        return _status_kb(self.pid, "VmRSS") * 1024

    def reset_peak_rss(self) -> None:
        # Linux: writing 5 resets VmHWM (peak RSS) to the current RSS.
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def peak_rss_bytes(self) -> int:
        return _status_kb(self.pid, "VmHWM") * 1024

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@contextlib.contextmanager
def engines(*procs: EngineProcess, log_dir: Path, names: Sequence[str]) -> Iterator[tuple[EngineProcess, ...]]:
    started = []
    try:
        for p, n in zip(procs, names, strict=True):
            started.append(p.start(log_dir, n))
        yield tuple(started)
    finally:
        for p in started:
            p.stop()
