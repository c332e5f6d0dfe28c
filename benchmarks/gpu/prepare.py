"""Prepare the GPU check on a CPU machine (with a package registry), for a GPU machine without one.

    python benchmarks/gpu/prepare.py [--check] [--with-cmake]

Writes into benchmarks/gpu/prepared/ (git-ignored; it travels as one carried path):

- ``llama_cpp_python-VER.tar.gz``: the installed llama-cpp-python version's sdist, trimmed to
  what a CUDA, Vulkan or CPU build needs: no other backends' sources, no models, tests,
  examples, docs, media, web-UI sources or .git;
- ``wheels/``: CPython 3.12 manylinux x86_64 wheels of the engine's dependencies and the test
  tools the GPU tests use (llama-cpp-python is built there; vllm-router and ruff are left out:
  the GPU tests need neither, and they are large);
- ``requirements.txt`` / ``constraints.txt``: what run.sh installs, pinned to the versions in
  this environment (the ones the CPU test suite passes with);
- ``manifest.json``: versions and sizes.

``--check`` also resolves the wheel set with ``pip install --dry-run --no-index`` for 3.12.
The project itself travels as the repository copy (run.sh installs it with --no-deps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "prepared"
sys.path.insert(0, str(REPO))  # run as a script: benchmarks/ is importable from the repo root
from benchmarks.llama_server import sdist_tree  # noqa: E402  (the one home of the sdist cache)

MiB = 1024 * 1024
CARRY_LIMIT = 64 * MiB
MARGIN = 8 * MiB  # what the repo + prepared/ must leave free under the carry limit
SDIST_LIMIT = 24 * MiB  # the trimmed sdist alone

# pip download / dry-run target: CPython 3.12 on manylinux x86_64 (the GPU machine: Python
# 3.12.3, glibc 2.39). pip matches each manylinux_2_N exactly: llguidance 1.9 ships
# manylinux_2_31 only, which a list stopping at 2_28 could not find.
PY = "3.12"
PLATFORMS = [
    "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
]

# Left out of the wheel set: built there, or not needed by the GPU tests and large.
EXCLUDE_REQS = {"llama-cpp-python", "vllm-router", "ruff"}
# Needed there beside the engine's own requirements: build llama-cpp-python with
# --no-build-isolation (scikit-build-core; CMake and ninja come with the machine, see
# --with-cmake), install the engine (setuptools), and bootstrap pip in a bare venv.
# Not pinned to this environment's versions: the project and the venv's own tools.
UNPINNED = {"hydra-trio", "pip", "setuptools", "wheel"}
BUILD_REQS = ["scikit-build-core>=0.9.2", "setuptools>=77", "pip", "ninja"]

# Paths (relative to the sdist root) dropped from the trimmed copy. A directory entry drops
# everything under it. Backends are only add_subdirectory'd when enabled, so leaving out the
# disabled ones' sources is safe; ggml-hip/ggml-musa only hold build files around ggml-cuda's
# sources (kept, they are tiny). ggml-vulkan is kept (about 0.3 MiB packed): the same sdist
# builds the Vulkan lane (run.sh --backend vulkan, on lavapipe where there is no GPU).
LC = "vendor/llama.cpp"
DROP = {
    ".git", ".github", "docker", "docs", "examples", "tests", "mkdocs.yml",
    f"{LC}/.git", f"{LC}/.github", f"{LC}/.devops", f"{LC}/build", f"{LC}/models",
    f"{LC}/docs", f"{LC}/examples", f"{LC}/tests", f"{LC}/media", f"{LC}/benches",
    f"{LC}/gguf-py", f"{LC}/conversion", f"{LC}/requirements", f"{LC}/skills", f"{LC}/ci",
    f"{LC}/pocs", f"{LC}/scripts/snapdragon", f"{LC}/scripts/jinja",
    # the web UI's sources: llama-server is built without an embedded UI (offline there)
    f"{LC}/tools/ui/src", f"{LC}/tools/ui/tests", f"{LC}/tools/ui/static",
    f"{LC}/tools/ui/package-lock.json",
    f"{LC}/tools/server/tests", f"{LC}/tools/server/bench", f"{LC}/tools/server/public_legacy",
    f"{LC}/tools/mtmd/tests", f"{LC}/tools/mtmd/legacy-models",
    *(f"{LC}/ggml/src/ggml-{b}" for b in (
        "cann", "et", "hexagon", "metal", "opencl", "openvino", "sycl", "virtgpu",
        "webgpu", "zdnn", "zendnn", "kompute",
    )),
}
# File names dropped anywhere: media and test assets, converter scripts.
DROP_NAME = re.compile(r".*\.(mp3|mp4|wav|png|jpg|jpeg|gif|webp|ico|gguf|pdf)$|^convert_.*\.py$")
# Must be in the trimmed copy (a cheap guard against trimming too much).
REQUIRED = [
    "PKG-INFO", "pyproject.toml", "CMakeLists.txt", "llama_cpp/__init__.py", "llama_cpp/llama_cpp.py",
    f"{LC}/CMakeLists.txt", f"{LC}/ggml/CMakeLists.txt", f"{LC}/ggml/src/CMakeLists.txt",
    f"{LC}/ggml/src/ggml-cuda/CMakeLists.txt", f"{LC}/ggml/src/ggml-cuda/ggml-cuda.cu",
    f"{LC}/ggml/src/ggml-vulkan/CMakeLists.txt", f"{LC}/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
    f"{LC}/ggml/src/ggml-vulkan/vulkan-shaders/vulkan-shaders-gen.cpp",
    f"{LC}/ggml/src/ggml-cpu/CMakeLists.txt", f"{LC}/tools/mtmd/CMakeLists.txt",
    f"{LC}/tools/server/CMakeLists.txt", f"{LC}/tools/ui/CMakeLists.txt",
    f"{LC}/scripts/ui-assets.cmake", f"{LC}/src/llama.cpp", f"{LC}/common/CMakeLists.txt",
]


def log(msg: str) -> None:
    print(msg, flush=True)


def mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def llama_cpp_version() -> str:
    return version("llama-cpp-python")


def kept(rel: str, is_dir: bool) -> bool:
    if rel in DROP or any(rel.startswith(d + "/") for d in DROP):
        return False
    name = rel.rsplit("/", 1)[-1]
    if name in ("__pycache__", ".DS_Store") or name.endswith(".pyc"):
        return False
    return is_dir or not DROP_NAME.match(name)


def write_trimmed_sdist(tree: Path, ver: str, out: Path) -> dict[str, int]:
    """tar.gz of the kept files under ``llama_cpp_python-VER/`` (a valid sdist layout)."""
    prefix = f"llama_cpp_python-{ver}"
    target = out / f"{prefix}.tar.gz"
    files = kept_bytes = total_bytes = 0
    present: set[str] = set()
    with tarfile.open(target, "w:gz", compresslevel=9) as tar:
        for dirpath, dirnames, filenames in os.walk(tree):
            rel_dir = Path(dirpath).relative_to(tree).as_posix()
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            dirnames[:] = sorted(d for d in dirnames if kept(rel_dir + d, True))
            for f in sorted(filenames):
                p = Path(dirpath) / f
                size = p.lstat().st_size
                total_bytes += size
                rel = rel_dir + f
                if not kept(rel, False) or p.is_symlink():
                    continue
                tar.add(p, arcname=f"{prefix}/{rel}", recursive=False)
                files += 1
                kept_bytes += size
                present.add(rel)
    missing = [r for r in REQUIRED if r not in present]
    if missing:
        raise SystemExit(f"trimmed sdist lacks required files: {missing}")
    packed = target.stat().st_size
    if packed > SDIST_LIMIT:
        raise SystemExit(f"trimmed sdist is {mib(packed)}, over its {mib(SDIST_LIMIT)} budget")
    # total_bytes counts only what was walked (dropped directories are pruned before walking)
    log(f"trimmed sdist: {files} files, {mib(kept_bytes)} unpacked -> {target.name} {mib(packed)}")
    return {"files": files, "unpacked_bytes": kept_bytes, "bytes": packed}


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def requirements(tree: Path, with_cmake: bool) -> list[str]:
    """The engine's dependencies and test extra, llama-cpp-python's own runtime dependencies,
    and the build tools; without the excluded ones."""
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    llama = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    reqs = [*proj["dependencies"], *proj["optional-dependencies"]["test"], *llama["dependencies"], *BUILD_REQS]
    if with_cmake:
        reqs.append("cmake>=3.21")
    out: list[str] = []
    seen: set[str] = set()
    for r in reqs:
        r = r.split("#", 1)[0].strip()
        n = _name(r)
        if n in EXCLUDE_REQS or n in seen:
            continue
        seen.add(n)
        out.append(r)
    return out


def constraints() -> list[str]:
    """name==version of everything installed here (what the CPU suite passes with), minus
    the excluded and local packages."""
    pins = {}
    for d in distributions():
        n = _name(d.metadata["Name"] or "")
        if n and n not in EXCLUDE_REQS and n not in UNPINNED:
            pins[n] = f"{n}=={d.version}"
    return [pins[k] for k in sorted(pins)]


def _platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PY, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def download_wheels(out: Path, reqs: list[str], pins: list[str]) -> dict[str, int]:
    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    (out / "requirements.txt").write_text("\n".join(reqs) + "\n")
    (out / "constraints.txt").write_text("\n".join(pins) + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
           *_platform_args(), "-r", str(out / "requirements.txt"), "-c", str(out / "constraints.txt"),
           "-d", str(wheels)]
    log(f"downloading the 3.12 wheels: {len(reqs)} requirements ...")
    subprocess.run(cmd, check=True)
    names = sorted(p.name for p in wheels.glob("*.whl"))
    dups = _duplicates(names)
    if dups:
        raise SystemExit(f"two versions of {dups} in {wheels}: pip would refuse the set")
    size = sum(p.stat().st_size for p in wheels.glob("*.whl"))
    log(f"wheels: {len(names)} files, {mib(size)}")
    for n in names:
        log(f"  {n}  {mib((wheels / n).stat().st_size)}")
    return {"files": len(names), "bytes": size}


def _duplicates(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    for n in names:
        k = n.split("-", 1)[0].lower()
        seen[k] = seen.get(k, 0) + 1
    return [k for k, v in seen.items() if v > 1]


def dry_run(out: Path) -> bool:
    """Does the wheel set alone satisfy the requirements for CPython 3.12? (pip needs --target
    with --python-version.)"""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--disable-pip-version-check",
               "--find-links", str(out / "wheels"), *_platform_args(), "--target", tmp,
               "--report", str(Path(tmp) / "report.json"), "--quiet",
               "-r", str(out / "requirements.txt"), "-c", str(out / "constraints.txt")]
        log("$ " + " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log(f"dry run FAILED (rc {r.returncode}):\n{r.stdout}{r.stderr}")
            return False
        report = json.loads((Path(tmp) / "report.json").read_text())
    n = len(report.get("install", []))
    log(f"dry run OK: the 3.12 set resolves completely with --no-index ({n} distributions would install)")
    return True


def repo_tracked_bytes() -> int:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    total = 0
    for rel in r.stdout.decode().split("\0"):
        p = REPO / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT, help="output folder (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="also resolve the wheel set with pip --dry-run --no-index")
    ap.add_argument("--with-cmake", action="store_true",
                    help="also carry the cmake wheel (~30 MiB; the GPU machine of this project has CMake)")
    ap.add_argument("--skip-sdist", action="store_true", help="keep the existing trimmed sdist")
    ap.add_argument("--skip-wheels", action="store_true", help="keep the existing wheels")
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    try:
        ver = llama_cpp_version()
    except PackageNotFoundError:
        raise SystemExit("llama-cpp-python is not installed here: its version decides the sdist") from None
    tree = sdist_tree(ver)
    manifest: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "llama_cpp_python": ver,
        "python": PY,
        "platforms": PLATFORMS,
        "excluded": sorted(EXCLUDE_REQS),
    }
    if not args.skip_sdist:
        for old in out.glob("llama_cpp_python-*.tar.gz"):
            old.unlink()
        manifest["sdist"] = write_trimmed_sdist(tree, ver, out)
    reqs = requirements(tree, args.with_cmake)
    if not args.skip_wheels:
        manifest["wheels"] = download_wheels(out, reqs, constraints())
    manifest["requirements"] = reqs
    ok = dry_run(out) if args.check else None
    manifest["dry_run_ok"] = ok

    prepared = dir_bytes(out)
    repo = repo_tracked_bytes()
    total = prepared + repo
    manifest.update(prepared_bytes=prepared, repo_tracked_bytes=repo, carry_total_bytes=total)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"prepared/ {mib(prepared)} + repo (tracked) {mib(repo)} = {mib(total)} "
        f"of the {mib(CARRY_LIMIT)} carry limit")
    if total > CARRY_LIMIT - MARGIN:
        log(f"TOO LARGE: leave at least {mib(MARGIN)} under the carry limit")
        return 1
    return 0 if ok is not False else 1


if __name__ == "__main__":
    sys.exit(main())
