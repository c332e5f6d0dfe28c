"""Docs that cannot drift: every repository path that docs/**/*.md, README.md and the
package's own docstrings and comments cite exists.

A cited path is a token ending in ``.py``, ``.md``, ``.sh`` or ``.toml`` outside a URL:
``engine/sched/batcher.py``, ``src/hydra_trio/app.py``, ``http/completions/chat_serving.py``,
``benchmarks/prefill.py``, ``tests/repo/test_docs.py``. It resolves against the repository root,
the package (``src/hydra_trio/``, so ``engine/...`` and ``http/...`` read as the package's),
or any folder between the citing file and the root (``sched/batcher.py`` inside
``engine/``). A bare file name (``families.py``) must be some file's name in the repository.

Pure text checks: no model, no llama_cpp.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "hydra_trio"

# Paths of other projects that the code cites by name, as their authors spell them.
ELSEWHERE = {
    "convert_hf_to_gguf.py",  # llama.cpp's converter
    "convert_lora_to_gguf.py",  # llama.cpp's LoRA converter
    "conversion/qwen.py",  # llama.cpp's converter, its Qwen part
}

_URL = re.compile(r"\b[a-z][a-z+.-]*://\S+")
_PATH = re.compile(r"(?<![\w./:~$-])((?:[A-Za-z_][\w.-]*/)*[A-Za-z_][\w-]*\.(?:py|md|sh|toml))(?![\w/])")


def _sources() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return docs + sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _repo_names() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False).stdout
    names = {Path(line).name for line in out.splitlines()}
    names.update(p.name for p in ROOT.rglob("*") if ".git" not in p.parts and ".venv" not in p.parts)
    return names


def cited_paths(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for m in _PATH.finditer(_URL.sub(" ", line)):
            found.append((number, m.group(1)))
    return found


def resolves(cited: str, citer: Path, names: set[str]) -> bool:
    if cited in ELSEWHERE:
        return True
    if "/" not in cited:
        return cited in names
    bases = [ROOT, PKG, *[d for d in citer.parents if d == ROOT or ROOT in d.parents]]
    return any((base / cited).exists() for base in bases)


def test_every_cited_path_exists() -> None:
    names = _repo_names()
    stale = [
        f"{src.relative_to(ROOT)}:{number}: {cited}"
        for src in _sources()
        for number, cited in cited_paths(src)
        if not resolves(cited, src, names)
    ]
    assert not stale, "paths cited that are not in the repository:\n" + "\n".join(stale)


def test_the_check_sees_a_stale_path(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("see `engine/batcher.py` and engine/sched/batcher.py, https://x.org/a/b.py\n")
    cited = [c for _, c in cited_paths(doc)]
    assert cited == ["engine/batcher.py", "engine/sched/batcher.py"]
    assert not resolves("engine/batcher.py", PKG / "app.py", set())
    assert resolves("engine/sched/batcher.py", PKG / "app.py", set())
    assert resolves("sched/batcher.py", PKG / "engine" / "core.py", set())
