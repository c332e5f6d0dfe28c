"""docs/architecture.md's map held against the tree: every module listed (and nothing that
is not there), llama_cpp imported only by engine/llama/, wire/ pure, chat/ and structured/
free of llama/, the settings naming no tool-call family (the roster's), and the import graph of the
layers (folders and top-level modules) without a circle, so no import runs back up; the
top of the package the composition root, the CLI and local engines, every other module (the
settings' too) in a room entered through its face. Rules of
shape, not sizes: a size limit became a target (modules at 599 of 600 lines)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "hydra_trio"
DOC = ROOT / "docs" / "architecture.md"


def modules() -> dict[str, Path]:
    """Module path relative to the package (``engine/llama/context.py``) -> file."""
    return {p.relative_to(PKG).as_posix(): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, as dotted names (relative imports resolved), also those
    under ``if TYPE_CHECKING:`` (a circle of type hints is a circle too)."""
    package = list(path.relative_to(PKG.parent).parts[:-1])  # the module's own package
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names)  # from . import x
    return out


def unit(module: str) -> str | None:
    """The layer a hydra_trio module belongs to: its top folder, or the top-level module."""
    parts = module.split(".")
    if parts[0] != "hydra_trio" or len(parts) < 2:
        return None
    return parts[1] + ("/" if (PKG / parts[1]).is_dir() else ".py")


def test_the_module_map_lists_every_module_and_only_those() -> None:
    """A row is a module, or a folder's ``*.py``: the modules of a folder that holds one
    module per member of a registry (engine/chat/families/), each registering itself, so
    that adding one is its file and its tests; the folder's own modules have rows of theirs."""
    rows = set(re.findall(r"^\| `([\w/]+(?:\*)?\.py)` \|", DOC.read_text(encoding="utf-8"), flags=re.M))
    listed = {r for r in rows if not r.endswith("/*.py")}
    folders = {r.removesuffix("*.py") for r in rows - listed}
    tree = {m for m in modules() if not m.endswith("__init__.py")}
    members = {m for m in tree - listed if any(m.startswith(f) and "/" not in m[len(f):] for f in folders)}
    assert tree - listed - members == set(), (
        f"modules missing from docs/architecture.md's map: {sorted(tree - listed - members)}"
    )
    assert listed - tree == set(), f"docs/architecture.md lists modules that are not there: {sorted(listed - tree)}"
    assert all(any(m.startswith(f) for m in members) for f in folders), (
        f"folders of no member module: {sorted(folders)}"
    )


def test_only_engine_llama_imports_llama_cpp() -> None:
    importers = {
        m for m, p in modules().items() if any(i == "llama_cpp" or i.startswith("llama_cpp.") for i in imports_of(p))
    }
    assert importers and all(m.startswith("engine/llama/") for m in importers), sorted(importers)


def test_wire_is_pure() -> None:
    for m, p in modules().items():
        if m.startswith("wire/"):
            ours = {i for i in imports_of(p) if i.startswith("hydra_trio.")}
            assert all(i.startswith("hydra_trio.wire") for i in ours), (m, ours)


def test_the_layers_import_each_other_without_a_circle() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for m, p in modules().items():
        src = unit("hydra_trio." + m.removesuffix(".py").replace("/", "."))
        for i in imports_of(p):
            dst = unit(i)
            if src and dst and dst != src and (PKG / dst.rstrip("/")).exists():
                edges[src].add(dst)
    # Depth-first search for a back edge: any circle among the layers fails.
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError("layers in a circle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_engine_llama_imports_nothing_of_the_engine_above_it() -> None:
    for m, p in modules().items():
        if m.startswith("engine/llama/"):
            ours = {i for i in imports_of(p) if i.startswith("hydra_trio.")}
            above = {
                i for i in ours if i.startswith("hydra_trio.engine.") and not i.startswith("hydra_trio.engine.llama")
            }
            assert not above, (m, sorted(above))


def test_callers_use_what_a_package_exports() -> None:
    """Outside engine/, only the face (``hydra_trio.engine``) is imported; inside engine/,
    a subpackage (chat/, speculation/, kv/, llama/, sched/, structured/, sample/) is reached
    through its own face only."""
    faces = ("chat", "speculation", "kv", "llama", "sched", "structured", "sample")
    for m, p in modules().items():
        for i in imports_of(p):
            if not i.startswith("hydra_trio.engine."):
                continue
            if not m.startswith("engine/"):
                # ``from ..engine import X`` reads as hydra_trio.engine.X for a name X.
                assert i.split(".")[2] in _face_names(), (m, i)
                continue
            parts = i.split(".")
            own = m.split("/")[1] if m.count("/") >= 2 else None
            if len(parts) >= 4 and parts[2] in faces and parts[2] != own:
                assert parts[3] in _package_names(parts[2]), (m, i)


# The rooms above the engine and wire/ whose face (``__init__.py``) is the only way in from
# outside: their modules are the room's own business.
ROOMS = ("concurrency", "config", "observability", "serving", "transport")
# What stays at the top of the package: the composition root, the CLI and local engines.
TOP_LEVEL = {"__init__.py", "app.py", "cli.py", "local.py"}


def test_the_top_of_the_package_holds_only_the_root_the_cli_and_local_engines() -> None:
    top = {p.name for p in PKG.glob("*.py")}
    assert top == TOP_LEVEL, f"a module at the top belongs in a room: {sorted(top - TOP_LEVEL)}"


def test_a_room_is_entered_through_its_face() -> None:
    """Outside concurrency/, config/, observability/, serving/ and transport/, a module (of the package,
    the tests, the benchmarks or the examples) imports the room itself, only names its face
    exports; inside, a module imports its room's modules directly."""
    callers = [(f"src/hydra_trio/{m}", imports_of(p)) for m, p in modules().items()]
    for folder in ("tests", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            callers.append((path.relative_to(ROOT).as_posix(), _absolute_imports(path)))
    for where, names in callers:
        for name in names:
            parts = name.split(".")
            if parts[0] != "hydra_trio" or len(parts) < 3 or parts[1] not in ROOMS:
                continue
            if where.startswith(f"src/hydra_trio/{parts[1]}/"):
                continue
            assert parts[2] in _package_names(None, parts[1]), (where, name)


def _absolute_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _face_names() -> set[str]:
    return _package_names(None)


def _package_names(sub: str | None, room: str = "engine") -> set[str]:
    """What a package's __init__.py exports (its ``__all__``)."""
    path = PKG / room / (sub or "") / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


def _module_of(name: str) -> Path | None:
    """The file of a dotted hydra_trio module name (a package's __init__.py), if it is one."""
    if not name.startswith("hydra_trio."):
        return None
    base = PKG.joinpath(*name.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def test_chat_and_structured_import_nothing_of_llama() -> None:
    """What a request's chat side and its grammar are is decided without llama.cpp: no module
    of chat/ or structured/ reaches engine/llama/ or llama_cpp, directly or through anything
    it imports (the packages' own faces aside: importing a subpackage runs them)."""
    for room in ("engine/chat/", "engine/structured/"):
        seen: set[Path] = set()
        todo = [p for m, p in modules().items() if m.startswith(room)]
        while todo:
            path = todo.pop()
            if path in seen:
                continue
            seen.add(path)
            for name in imports_of(path):
                assert not (name == "llama_cpp" or name.startswith("llama_cpp.")), (room, path, name)
                assert not name.startswith("hydra_trio.engine.llama"), (room, path, name)
                found = _module_of(name)
                if found is not None and found != PKG / "engine" / "__init__.py":
                    todo.append(found)


def test_the_settings_keep_no_list_of_tool_call_families() -> None:
    """--tool-call-parser's words are the roster's (engine/chat/families/), handed to the
    settings by the CLI (tests/engine/chat/test_toolcall_registry.py): config/ names no family."""
    from hydra_trio.engine.chat.formats import FORMATS

    lists = [
        {e.value for e in node.elts if isinstance(e, ast.Constant)}
        for path in sorted((PKG / "config").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Tuple | ast.List | ast.Set)
    ]
    assert not [words & set(FORMATS) for words in lists if len(words & set(FORMATS)) > 1]


def test_the_front_ends_reach_only_the_engines_face() -> None:
    from hydra_trio.engine import Engine

    assert Engine.prepare  # the one request policy and plan: the front ends' way in
    # No front end goes through the face into a second attribute (``engine.x.y``), nor holds
    # a slot by hand: a slot's life is ``async with engine.claim(...)``.
    chain = re.compile(r"\bengine\.(\w+)\.(\w+)")
    for m, p in modules().items():
        if m.split("/")[0] in ("http", "rpc", "decode", "handoff"):
            text = p.read_text(encoding="utf-8")
            assert not chain.search(text), (m, chain.search(text))
            assert ".release(slot" not in text and "slot_claim" not in text, m


def test_no_module_name_is_used_twice() -> None:
    """A module's file name says one thing across the package: two ``server.py`` or two
    ``metrics.py`` in different rooms make a reader (and a traceback) guess which. Packages'
    faces (``__init__.py``) and entry points (``__main__.py``) are the exceptions."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for m in modules():
        name = m.rsplit("/", 1)[-1]
        if name not in ("__init__.py", "__main__.py"):
            by_name[name].append(m)
    twice = {name: where for name, where in by_name.items() if len(where) > 1}
    assert not twice, f"module names used more than once: {twice}"
