"""A fleet across hosts on one machine: each engine in its own network namespace, all on one
link-local segment (169.254.N.0/24), for tests/system/test_fleet_netns.py and ``python -m
benchmarks.fleet``.

Layout: a "switch" namespace holds a bridge; every host namespace, and the caller's own
namespace (the root one, where the router and the clients run), is joined to it by a veth
pair. No forwarding or NAT is needed (one L2 segment), and nothing outside the namespaces
made here is changed except the caller's end of its veth. A link is cut by setting a host's
bridge-side end down (``Fabric.cut``): packets in either direction are dropped, as when a
cable is pulled; the engine's process and sockets are untouched.

Needs root and ``ip netns`` (iproute2); ``available()`` says why not, for a clean skip.
Everything made is named with the creating process's pid and removed by ``Fabric.close``
(deleting a namespace deletes the veth ends inside it, and with them their peers)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def available() -> str | None:
    """None when namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"hnprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "-n", ns, *args] if ns else ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


@dataclass
class Host:
    ns: str
    addr: str
    link: str  # the bridge-side end of its veth (in the switch namespace)

    def cmd(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Fabric:
    """``n`` host namespaces and the caller on one bridge. Use as a context manager."""

    n: int
    subnet: int = 0  # the N of 169.254.N.0/24; 0: derived from the pid
    tag: str = field(default_factory=lambda: f"h{os.getpid() % 100000}")
    hosts: list[Host] = field(default_factory=list)
    made: list[str] = field(default_factory=list)
    caller_addr: str = ""

    def __enter__(self) -> Fabric:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _build(self) -> None:
        net = self.subnet or 100 + os.getpid() % 100
        sw = f"{self.tag}sw"
        _ip("netns", "add", sw)
        self.made.append(sw)
        _ip("link", "add", "br0", "type", "bridge", ns=sw)
        _ip("link", "set", "br0", "up", ns=sw)
        # The caller's own leg: its end stays here, the peer goes to the switch.
        me, me_b = f"{self.tag}c", f"{self.tag}cb"
        _ip("link", "add", me, "type", "veth", "peer", "name", me_b)
        _ip("link", "set", me_b, "netns", sw)
        _ip("link", "set", me_b, "master", "br0", ns=sw)
        _ip("link", "set", me_b, "up", ns=sw)
        self.caller_addr = f"169.254.{net}.1"
        _ip("addr", "add", f"{self.caller_addr}/24", "dev", me)
        _ip("link", "set", me, "up")
        for i in range(self.n):
            ns, end, b = f"{self.tag}n{i}", f"{self.tag}v{i}", f"{self.tag}b{i}"
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", end, "type", "veth", "peer", "name", b)
            _ip("link", "set", end, "netns", ns)
            _ip("link", "set", b, "netns", sw)
            _ip("link", "set", b, "master", "br0", ns=sw)
            _ip("link", "set", b, "up", ns=sw)
            addr = f"169.254.{net}.{10 + i}"
            _ip("addr", "add", f"{addr}/24", "dev", end, ns=ns)
            _ip("link", "set", end, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            self.hosts.append(Host(ns, addr, b))
        self._switch = sw  # reachability is what each engine's /health wait shows

    def cut(self, i: int) -> None:
        """Pull host ``i``'s cable: its bridge port goes down."""
        _ip("link", "set", self.hosts[i].link, "down", ns=self._switch)

    def mend(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].link, "up", ns=self._switch)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", f"{self.tag}c"], capture_output=True)
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


@dataclass
class NetnsEngine:
    """``hydra-trio serve`` inside a host namespace, bound to that host's address, allowing
    hand-off pulls and RPC from the segment."""

    host: Host
    model: str
    net: str  # the segment, CIDR
    log_dir: Path
    name: str
    http_port: int = 8000
    rpc_port: int = 9000
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.addr}:{self.http_port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self, timeout: float = 120.0) -> NetnsEngine:
        src = str(Path(__file__).resolve().parent.parent / "src")
        env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = self.host.cmd(
            sys.executable, "-m", "hydra_trio.cli", "serve",
            "--model", self.model, "--host", self.host.addr,
            "--port", str(self.http_port), "--rpc-port", str(self.rpc_port),
            "--kv-pull-allow", self.net, "--rpc-allow", self.net,
            "--threads", "1", "--log-level", "WARNING",
            *self.extra,
        )  # fmt: skip
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not answer {self.url}/health within {timeout} s")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        """SIGINT, then SIGKILL; a stopped (SIGSTOP) process is continued first."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
