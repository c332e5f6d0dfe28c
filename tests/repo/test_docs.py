"""The documentation a user navigates: README.md and docs/**/*.md.

- every relative link (and its #anchor, by GitHub's heading slugs) resolves inside the repo;
- every `hydra-trio serve` flag is in docs/operations.md;
- README's quick-start test command is the one .ci/run executes.

Pure text checks: no model, no llama_cpp.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from hydra_trio.config import add_arguments

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target may be <...> or carry a "title".
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:name|id)=[\"']([^\"']+)[\"']", re.IGNORECASE)


def _prose_lines(text: str) -> list[tuple[int, str, str]]:
    """(number, line, line with inline code blanked) of the lines outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line.lstrip())
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            out.append((number, line, _INLINE_CODE.sub(lambda c: " " * len(c.group(0)), line)))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lowercase, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: letters, digits, underscore (Unicode)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The #anchors GitHub gives a Markdown file: one per heading (a repeated slug gets -1,
    -2, ...), and explicit <a name|id=...>."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for _, line, _ in _prose_lines(text):
        m = _HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    found.update(a.lower() for a in _HTML_ANCHOR.findall(text))
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, _, line in _prose_lines(path.read_text(encoding="utf-8")):
        targets = [m.group(1) for m in _LINK.finditer(line)]
        ref = _REF_DEF.match(line)
        if ref:
            targets.append(ref.group(1))
        for target in targets:
            target = target.strip("<>")
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue  # http:, https:, mailto: ...
            links.append((number, target))
    return links


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where} leaves the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def test_github_slug_rules():
    assert github_slug("Quick start") == "quick-start"
    assert github_slug("6.1 `GET /v1/decode/{id}`") == "61-get-v1decodeid"
    assert github_slug("2.2 STATE_PUT (0x31)") == "22-state_put-0x31"
    assert (
        github_slug("7. KV events (`--kv-events-endpoint`): what the slots hold, for cache-aware routers")
        == "7-kv-events---kv-events-endpoint-what-the-slots-hold-for-cache-aware-routers"
    )
    assert github_slug("vLLM's gauges for routers and autoscalers") == "vllms-gauges-for-routers-and-autoscalers"


def test_the_docs_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    for page in ("http-api", "rpc-protocol", "protocol-extensions", "operations", "scaling-out",
                 "gpu", "performance", "reliability", "architecture"):
        assert f"docs/{page}.md" in names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    assert broken_links(path) == []


def test_a_broken_link_is_caught(tmp_path: Path, monkeypatch):
    """The check itself: a missing file and a missing anchor are both reported."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Real `section` (x)\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#real-section-x) [ok](#t) [web](https://example.com/x.md)\n"
        "# T\n```\n[in code](nowhere.md)\n```\n`[code](nowhere.md)`\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#no-such) ![img](pic.png) [out](../../etc/passwd)\n"
    )
    problems = broken_links(page)
    assert len(problems) == 4, problems
    assert any("docs/b.md: no such file" in p for p in problems)
    assert any("#no-such" in p for p in problems)
    assert any("pic.png" in p for p in problems)
    assert any("leaves the repository" in p for p in problems)


def serve_flags() -> list[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return sorted(
        {opt for action in parser._actions for opt in action.option_strings if opt.startswith("--") and opt != "--help"}
    )


def test_every_flag_is_in_operations():
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    flags = serve_flags()
    assert "--model" in flags and "--no-log-requests" in flags
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)]
    assert missing == [], f"flags of `hydra-trio settings` missing from docs/operations.md: {missing}"


def _ci_test_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "# The README's test command:":
            return lines[i + 1].strip()
    raise AssertionError(".ci/run lost its '# The README's test command:' marker")


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)\n```", section, re.DOTALL)


def test_readme_quick_start_commands():
    blocks = _quick_start_commands()
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install . && hydra-trio serve" in blocks
    ci = _ci_test_command()
    assert ci == "python -m pytest -q --durations=15"  # CI prints the 15 slowest tests
    tests = [b for b in blocks if "pytest" in b]
    assert tests == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test,realmodel]' && " + ci
    ], tests
    # CI installs the same extras as the README's test command.
    assert "pip install --quiet -e '.[test,realmodel]'" in (ROOT / ".ci" / "run").read_text()
