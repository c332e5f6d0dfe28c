"""Writing the corpus: captures scrubbed of machine-specific values, large repeated values
(tool lists, system prompts, long messages) stored once under ``shared/`` by content hash, and
``index.json`` describing every file. The replay (tests/system/test_client_corpus.py) reads it back.

Layout under the corpus folder (tests/corpus):
- ``captures/<client>/<scenario>.json``: ``{"client", "versions", "scenario", "note"?,
  "requests": [{"turn", "method", "path", "dialect", "headers", "recorder_reply", "body"}]}``
- ``schemas/<source>.json``: ``{"source", "versions", "schemas": {name: schema}}``: schemas
  a library writes (pydantic, zod) that the replay wraps into requests itself;
- ``shared/<hash>.json``: a value that ``{"$corpus_ref": "<hash>"}`` stands for;
- ``index.json``: one entry per file.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

# Values of these keys (in a body, and the items of its message lists) larger than this are
# stored once: Claude Code repeats a ~40 KB tool list and its system prompt on every turn.
SHARED_KEYS = ("tools", "system", "instructions")
LIST_KEYS = ("messages", "input")
SHARED_MIN_BYTES = 2000

_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def scrub(value: Any, paths: dict[str, str]) -> Any:
    """The value with this machine's paths replaced and ids (UUIDs, 64-hex device ids) zeroed:
    a capture says nothing of where or by whom it was recorded, and re-recording the same
    client gives the same bytes where the client sends the same request."""
    if isinstance(value, str):
        for old, new in paths.items():
            value = value.replace(old, new)
        value = _UUID.sub("00000000-0000-0000-0000-000000000000", value)
        return _HEX64.sub("0" * 64, value)
    if isinstance(value, list):
        return [scrub(v, paths) for v in value]
    if isinstance(value, dict):
        return {k: scrub(v, paths) for k, v in value.items()}
    return value


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.shared: dict[str, Any] = {}

    def _ref(self, value: Any) -> Any:
        text = canonical(value)
        if len(text.encode()) < SHARED_MIN_BYTES:
            return value
        key = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.shared[key] = value
        return {"$corpus_ref": key}

    def share(self, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        out = dict(body)
        for key in SHARED_KEYS:
            if key in out:
                out[key] = self._ref(out[key])
        for key in LIST_KEYS:
            if isinstance(out.get(key), list):
                out[key] = [self._ref(item) for item in out[key]]
        return out

    def write_capture(self, client: str, scenario: str, doc: dict[str, Any]) -> Path:
        doc = {**doc, "requests": [{**r, "body": self.share(r["body"])} for r in doc["requests"]]}
        path = self.root / "captures" / client / f"{scenario}.json"
        _write(path, doc)
        return path

    def write_schemas(self, source: str, doc: dict[str, Any]) -> Path:
        path = self.root / "schemas" / f"{source}.json"
        _write(path, doc)
        return path

    def finish(self) -> None:
        """Write the shared values, drop those nothing refers to any more, rebuild the index."""
        for key, value in self.shared.items():
            _write(self.root / "shared" / f"{key}.json", value)
        used: set[str] = set()
        for path in (self.root / "captures").rglob("*.json"):
            used.update(re.findall(r'"\$corpus_ref": "([0-9a-f]{16})"', path.read_text()))
        for path in (self.root / "shared").glob("*.json"):
            if path.stem not in used:
                path.unlink()
        _write(self.root / "index.json", build_index(self.root))


def build_index(root: Path) -> list[dict[str, Any]]:
    index: list[dict[str, Any]] = []
    for path in sorted((root / "captures").rglob("*.json")):
        doc = json.loads(path.read_text())
        requests = []
        for r in doc["requests"]:
            body = r["body"] if isinstance(r["body"], dict) else {}
            tools = resolve(body.get("tools"), root) or []
            requests.append({
                "dialect": r["dialect"],
                "path": r["path"],
                "stream": bool(body.get("stream")),
                "tools": len(tools),
                "tool_choice": body.get("tool_choice"),
                "typed_answer": any(k in body for k in ("response_format", "output_format"))
                or "format" in (body.get("output_config") or {})
                or "format" in (body.get("text") or {}),
                "recorder_reply": r["recorder_reply"],
            })
        index.append({"file": path.relative_to(root).as_posix(), "kind": "capture", "client": doc["client"],
                      "versions": doc["versions"], "scenario": doc["scenario"], "note": doc.get("note"),
                      "requests": requests})
    for path in sorted((root / "schemas").glob("*.json")):
        doc = json.loads(path.read_text())
        index.append({"file": path.relative_to(root).as_posix(), "kind": "schemas", "client": doc["source"],
                      "versions": doc["versions"], "schemas": sorted(doc["schemas"])})
    return index


def resolve(value: Any, root: Path) -> Any:
    """``value`` with every ``{"$corpus_ref": key}`` replaced by ``shared/<key>.json``."""
    if isinstance(value, dict):
        if set(value) == {"$corpus_ref"}:
            return resolve(json.loads((root / "shared" / f"{value['$corpus_ref']}.json").read_text()), root)
        return {k: resolve(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, root) for v in value]
    return value


def _write(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n")
