"""Shared fixtures: synthetic GGUF models written once per session, and live engines
started in-process on ephemeral ports."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, settings

from hydra_trio.config import Settings

# Property tests: the same examples on every run and machine (derandomized, no example
# database), and no wall-clock deadline or too-slow check, which a loaded machine trips
# (a test's own @settings overrides a field, and inherits the rest).
settings.register_profile(
    "hydra", deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("hydra")

# A test that takes one of these starts an engine (or loads a model into llama.cpp): it is
# ``slow`` by that alone, so ``pytest -m "not slow"`` (the quick loop, under a minute) skips it
# with no mark to remember. Files that start engines or servers some other way, or run
# campaigns, carry ``pytestmark = pytest.mark.slow`` (docs/testing in README.md).
ENGINE_FIXTURES = frozenset(
    {"start_engine", "engine", "ctx_engine", "run_engine", "gemma_model", "serve_process"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_dir: Path) -> Path:
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "tiny.gguf", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_other(model_dir: Path) -> Path:
    """Same shape as tiny_model, different weights and name (a "different model")."""
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "tiny-other.gguf", "tiny", seed=1, name="Other Tiny")


@pytest.fixture(scope="session")
def tiny_model_wide(model_dir: Path) -> Path:
    """A different shape (n_vocab differs): KV from it must be refused by tiny_model."""
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "tiny-wide.gguf", "tiny", seed=2, n_vocab=600, name="Hydra Synthetic Tiny")


@pytest.fixture(scope="session")
def mamba_model(model_dir: Path) -> Path:
    """A recurrent model (llama.cpp's mamba architecture): one state per sequence, which no
    cut keeps (context checkpoints, truncation)."""
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "mamba.gguf", "mamba", seed=0)


@pytest.fixture(scope="session")
def hybrid_model(model_dir: Path) -> Path:
    """A hybrid model (llama.cpp's lfm2 architecture): short-convolution layers with a
    recurrent state beside attention layers with a KV cache; its sequence state holds both."""
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "hybrid.gguf", "hybrid", seed=0)


@pytest.fixture(scope="session")
def embed_model(model_dir: Path) -> Path:
    """An embedding model (the embed preset: llama with mean pooling); it generates too."""
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "embed.gguf", "embed", seed=0)


@pytest.fixture(scope="session")
def rerank_model(model_dir: Path) -> Path:
    """A reranker (the rerank preset: Qwen3-Reranker's layout, a rank head and template)."""
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "rerank.gguf", "rerank", seed=0)


@pytest.fixture(scope="session")
def bert_model(model_dir: Path) -> Path:
    """An encoder (the bert preset: no KV cache, no LM head, WordPiece, mean pooling)."""
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "bert.gguf", "bert", seed=0)


@pytest.fixture(scope="session")
def fim_model(model_dir: Path) -> Path:
    """A code model with fill-in-the-middle tokens (the fim preset)."""
    from hydra_trio.model.synthetic import write_model

    return write_model(model_dir / "fim.gguf", "fim", seed=0)


@pytest.fixture(scope="session")
def tiny_model_ctx(model_dir: Path) -> Path:
    """Same shape and vocabulary as tiny_model, with 10x stronger layer weights.

    tiny_model's residual stream is dominated by the current token's embedding, so its
    greedy text is the same for every prompt (a bigram chain): it cannot tell a correct KV
    from a wrong one. This model's text depends on the whole context, which makes "same
    greedy text" comparisons (restarts, restored KV, batching) meaningful.
    """
    from hydra_trio.model import synthetic

    orig = synthetic._tensor

    def stronger(rng: Any, shape: tuple[int, ...], dtype: type, std: float) -> Any:
        return orig(rng, shape, dtype, 0.2 if std == 0.02 else std)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synthetic, "_tensor", stronger)
        return synthetic.write_model(model_dir / "tiny-ctx.gguf", "tiny", seed=3, name="Hydra Synthetic Tiny Ctx")


@pytest.fixture(scope="session")
def wide_kv_model(model_dir: Path) -> Path:
    """16 layers x 256 wide, full KV heads: 16 KB of KV per token, so a few hundred tokens
    make a slot of megabytes (larger than what loopback socket buffers absorb: the sender's
    buffer autotunes up to net.ipv4.tcp_wmem's 4 MB maximum)."""
    import gguf

    from hydra_trio.model import synthetic

    preset = synthetic.Preset(512, 256, 16, 4, 4, 64, 4096, gguf.LlamaFileType.MOSTLY_F16, "Hydra Wide KV")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synthetic.PRESETS, "wide-kv", preset)
        return synthetic.write_model(model_dir / "wide-kv.gguf", "wide-kv")


@pytest.fixture(scope="session")
def tiny_model_hd32(model_dir: Path) -> Path:
    """tiny_model's size with 2 heads of 32: quantized KV cache types (blocks of 32 values)
    need a head dimension they divide, which tiny_model's 16 is not."""
    import gguf

    from hydra_trio.model import synthetic

    preset = synthetic.Preset(512, 64, 2, 2, 2, 192, 4096, gguf.LlamaFileType.ALL_F32, "Hydra Synthetic Tiny HD32")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synthetic.PRESETS, "tiny-hd32", preset)
        return synthetic.write_model(model_dir / "tiny-hd32.gguf", "tiny-hd32")


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF, assembled once into the user cache (later runs reuse
    it). Tests using it are marked ``realmodel`` and skip when its package is absent."""
    from hydra_trio.model.registry import ModelPackageMissing, named_model_path

    try:
        return named_model_path("gemma3-270m")
    except ModelPackageMissing as exc:
        pytest.skip(f"real model not installed: {exc}")


def test_settings(model: Path, **overrides: Any) -> Settings:
    base = Settings(
        model=str(model),
        host="127.0.0.1",
        port=0,
        rpc_port=0,
        slots=2,
        ctx_size=4096,  # 2048 a slot (split KV cache, the default)
        threads=1,  # one llama thread: the trio thread keeps a core on 2-core machines
        batch_size=64,
        default_n_predict=16,
        slot_wait_s=5.0,
        decode_validate_timeout_s=10.0,
        log_level="DEBUG",
    )
    return replace(base, **overrides)


@pytest.fixture
def start_engine(nursery: trio.Nursery) -> Callable[..., Any]:
    """``await start_engine(model_path, **settings)`` -> Endpoints; stopped at teardown."""
    from hydra_trio.app import serve

    async def start(model: Path, **overrides: Any) -> Any:
        return await nursery.start(serve, test_settings(model, **overrides))

    return start


@pytest.fixture
async def engine(start_engine: Callable[..., Any], tiny_model: Path) -> AsyncIterator[Any]:
    yield await start_engine(tiny_model)


@pytest.fixture
async def ctx_engine(start_engine: Callable[..., Any], tiny_model_ctx: Path) -> AsyncIterator[Any]:
    """A live engine serving tiny_model_ctx (context-sensitive greedy text)."""
    yield await start_engine(tiny_model_ctx, threads=1)


@pytest.fixture(autouse=True)
def _quiet_llama_logs() -> None:
    logging.getLogger("hydra_trio.llama_cpp").setLevel(logging.WARNING)


@pytest.fixture
def run_engine() -> Callable[..., Any]:
    """``async with run_engine(model_path, **settings) as ep:`` -> Endpoints; the engine is
    stopped when the block ends (for restarts inside one test)."""
    from hydra_trio.app import serve

    @asynccontextmanager
    async def run(model: Path, **overrides: Any) -> AsyncIterator[Any]:
        async with trio.open_nursery() as nursery:
            ep = await nursery.start(serve, test_settings(model, **{"threads": 1, **overrides}))
            try:
                yield ep
            finally:
                nursery.cancel_scope.cancel()

    return run
