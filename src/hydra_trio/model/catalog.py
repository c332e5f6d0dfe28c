"""The models a process serves by name (``--model NAME=PATH`` repeated, ``--models-dir``), which
one the RPC port serves (``--rpc-model``) and which stay loaded (``--model-pin``): read and
checked once at start, so a bad flag stops the start with one clear line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# A models-dir file with one of these in its name goes with a model, it is not one
# (llama-server's rules: projectors, and its draft-model prefixes).
_MMPROJ = "mmproj"
_DRAFT_PREFIXES = ("mtp-", "dspark-", "dflash-")


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str  # what a request's ``model`` says
    path: str  # the GGUF
    source: str  # "flag" (--model NAME=PATH) or "models_dir", as llama-server's ``source``


@dataclass(frozen=True, slots=True)
class Catalog:
    entries: tuple[CatalogEntry, ...]  # --model NAME=PATH in flag order, then --models-dir by name
    rpc_model: str  # served on the RPC port; pinned
    pinned: frozenset[str]  # loaded at start, never evicted or put to sleep (rpc_model included)

    def entry(self, name: str) -> CatalogEntry | None:
        return next((e for e in self.entries if e.name == name), None)


def _companion(file_name: str) -> bool:
    return _MMPROJ in file_name or file_name.startswith(_DRAFT_PREFIXES)


def scan_models_dir(folder: str) -> list[CatalogEntry]:
    """llama-server's layout: ``NAME.gguf`` files at the top, and folders ``NAME/`` holding one
    model (its first shard ``*-00001-of-*.gguf`` when it is split); projector and draft files
    are skipped. Sorted by name."""
    root = Path(folder)
    if not root.is_dir():
        raise SystemExit(f"--models-dir {folder}: not a folder")
    found: list[CatalogEntry] = []
    for item in sorted(root.iterdir()):
        if item.is_dir():
            ggufs = sorted(
                p for p in item.iterdir() if p.name.endswith(".gguf") and p.is_file() and not _companion(p.name)
            )
            shards = [p for p in ggufs if "-00001-of-" in p.name]
            if shards or ggufs:
                found.append(CatalogEntry(item.name, str((shards or ggufs)[0]), "models_dir"))
        elif item.name.endswith(".gguf") and item.is_file() and not _companion(item.name):
            found.append(CatalogEntry(item.name.removesuffix(".gguf"), str(item), "models_dir"))
    return sorted(found, key=lambda e: e.name)


def _bad_name(name: str) -> str | None:
    if not name or name != name.strip() or any(c in name for c in ",=/"):
        return f"model name {name!r} must be non-empty, without surrounding spaces, ',', '=' or '/'"
    return None


def read_catalog(named: tuple[str, ...], models_dir: str | None, pins: str, rpc_model: str | None) -> Catalog:
    """The catalog of ``--model NAME=PATH`` entries (``named``) and ``--models-dir``; SystemExit
    naming the flag for anything that cannot be served (a missing file, a name given twice, a
    pin or RPC model that names no model)."""
    entries: list[CatalogEntry] = []
    for item in named:
        name, _, path = item.partition("=")
        if (problem := _bad_name(name)) is not None:
            raise SystemExit(f"--model {item}: {problem}")
        if not os.path.isfile(path):
            raise SystemExit(f"--model {item}: no such file {path!r}")
        entries.append(CatalogEntry(name, path, "flag"))
    if models_dir is not None:
        flagged = {e.name for e in entries}
        # An explicit NAME=PATH wins over a file of the folder with that name.
        entries += [e for e in scan_models_dir(models_dir) if e.name not in flagged]
        if not entries:
            raise SystemExit(f"--models-dir {models_dir}: holds no GGUF model (NAME.gguf, or NAME/ with one)")
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"--model: {', '.join(twice)} named more than once")
    rpc = rpc_model or names[0]
    pinned = {p.strip() for p in pins.split(",") if p.strip()} | {rpc}
    unknown = sorted(n for n in pinned if n not in names)
    if unknown:
        flag = "--rpc-model" if rpc in unknown else "--model-pin"
        raise SystemExit(f"{flag}: no model named {', '.join(unknown)} (served: {', '.join(names)})")
    return Catalog(tuple(entries), rpc, frozenset(pinned))
