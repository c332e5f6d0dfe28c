"""Image input (--mmproj): the synthetic vision preset loads in llama.cpp's mtmd; an image in
each dialect (OpenAI image_url, Anthropic image, Responses input_image) takes the projector's
positions in the prompt; the prefix cache tells images apart by their bytes; bad images and
URLs get a 400 in the route's own shape; and the prompt's token count is llama-server's."""

from __future__ import annotations

import base64
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from helpers import http
from hydra_trio.engine.llama import Span, image_ids, is_image_start, media_spans
from hydra_trio.model.synthetic_vision import image_tokens, mmproj_path, write_vision_model


def png(width: int, height: int, seed: int) -> bytes:
    """A deterministic RGB PNG (no imaging library needed)."""
    state = seed * 2654435761 % 2**32 or 1
    rows = []
    for _ in range(height):
        row = bytearray(b"\x00")
        for _ in range(width * 3):
            state = (state * 1103515245 + 12345) % 2**31
            row.append(state >> 23)
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


def data_uri(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


IMAGE_A, IMAGE_B = png(40, 30, 1), png(40, 30, 2)
N_IMAGE = image_tokens()


def image_message(image: bytes, text: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_uri(image)}}],
        }
    ]


@pytest.fixture(scope="session")
def vision_model(model_dir: Path) -> Path:
    model, proj = write_vision_model(model_dir / "vision.gguf", seed=0)
    assert proj == mmproj_path(model)
    return model


@pytest.fixture
async def vision_engine(start_engine: Callable[..., Any], vision_model: Path) -> Any:
    return await start_engine(vision_model, mmproj=str(mmproj_path(vision_model)))


def test_make_model_vision_preset(tmp_path: Path) -> None:
    import gguf

    out = tmp_path / "v.gguf"
    done = subprocess.run([sys.executable, "-m", "hydra_trio.cli", "make-model", "--preset", "vision", str(out)],
                          capture_output=True, text=True, check=True, env={**os.environ})
    assert done.stdout.split() == [str(out), str(out) + ".mmproj.gguf"]
    proj = gguf.GGUFReader(str(out) + ".mmproj.gguf")
    fields = {f.name: f for f in proj.fields.values()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "clip"
    assert bytes(fields["clip.projector_type"].parts[-1]).decode() == "mlp"
    text = gguf.GGUFReader(str(out))
    n_embd = int(next(f for f in text.fields.values() if f.name == "llama.embedding_length").parts[-1][0])
    assert int(fields["clip.vision.projection_dim"].parts[-1][0]) == n_embd


async def test_chat_image_url_counts_image_positions(vision_engine: Any) -> None:
    async with http(vision_engine) as c:
        plain = await c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "What is in this picture?"}],
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        with_image = await c.post(
            "/v1/chat/completions", json={"messages": image_message(IMAGE_A), "max_tokens": 4, "temperature": 0}
        )
        assert plain.status_code == 200 and with_image.status_code == 200, with_image.text
        assert with_image.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + N_IMAGE
        streamed = await c.post(
            "/v1/chat/completions",
            json={
                "messages": image_message(IMAGE_A),
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert streamed.status_code == 200 and "data: [DONE]" in streamed.text


async def test_prefix_cache_tells_images_apart(vision_engine: Any) -> None:
    async with http(vision_engine) as c:
        async def cached(image: bytes) -> tuple[int, int]:
            r = await c.post(
                "/v1/chat/completions", json={"messages": image_message(image), "max_tokens": 2, "temperature": 0}
            )
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

        n, first = await cached(IMAGE_A)
        _, again = await cached(IMAGE_A)
        _, other = await cached(IMAGE_B)
        image_start = n - N_IMAGE - 5  # "<|im_end|>\n<|im_start|>assistant\n" follows the image: 5 tokens
        assert first == 0
        assert again >= image_start + N_IMAGE  # the same image: its positions reused
        assert other <= image_start  # another image: nothing from its first position on
    core = vision_engine.state.engine._core
    held = [media_spans(core.backend.seq_tokens[s]) for s in (0, 1)]
    ids = {tuple(core.backend.seq_tokens[s][sp.start : sp.end]) for s in (0, 1) for sp in held[s]}
    assert len(ids) == 2  # each image its own ids in the slots' token lists
    assert all(len(set(i)) == N_IMAGE for i in ids)  # one id a position: a match needs all of them


def test_image_ids_make_spans_from_the_list_alone() -> None:
    a, b = image_ids("aa" * 32, 4), image_ids("bb" * 32, 4)
    assert all(t < 0 for t in a + b) and len(set(a + b)) == 8
    assert [is_image_start(t) for t in a] == [True, False, False, False]
    tokens = [5, *a, *a, 7, *b, 9, *b[:2]]  # the same image twice back to back; a history cut inside one
    assert media_spans(tokens) == [Span(1, 5), Span(5, 9), Span(10, 14), Span(15, 17)]
    with pytest.raises(ValueError):
        media_spans([5, *a[1:]])


async def test_anthropic_and_responses_images(vision_engine: Any) -> None:
    b64 = base64.b64encode(IMAGE_A).decode()
    async with http(vision_engine) as c:
        plain = await c.post(
            "/v1/messages",
            json={"max_tokens": 2, "messages": [{"role": "user", "content": "What is in this picture?"}]},
        )
        r = await c.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] == plain.json()["usage"]["input_tokens"] + N_IMAGE
        plain = await c.post("/v1/responses", json={"max_output_tokens": 2, "input": "What is in this picture?"})
        r = await c.post(
            "/v1/responses",
            json={
                "max_output_tokens": 2,
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is in this picture?"},
                            {"type": "input_image", "image_url": data_uri(IMAGE_A)},
                        ],
                    }
                ],
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] == plain.json()["usage"]["input_tokens"] + N_IMAGE
        bad = await c.post(
            "/v1/messages",
            json={
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": base64.b64encode(b"not an image").decode(),
                                },
                            }
                        ],
                    }
                ],
            },
        )
        assert bad.status_code == 400 and bad.json()["type"] == "error" and "decoded" in bad.json()["error"]["message"]
        bad = await c.post(
            "/v1/responses",
            json={
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,@@@"}]}
                ]
            },
        )
        assert bad.status_code == 400 and "base64" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (data_uri(b"\x89PNG\r\n\x1a\nbroken"), "could not be decoded"),
        ("data:image/png;base64,!!!", "not valid base64"),
        ("data:text/plain;base64,aGk=", "data:image/"),
        ("file:///etc/passwd", "--media-path"),
        ("https://example.com/cat.png", "--media-url-prefix"),
        ("ftp://example.com/cat.png", "scheme"),
    ],
)
async def test_bad_images_get_400(vision_engine: Any, url: str, says: str) -> None:
    async with http(vision_engine) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]},
        )
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


async def test_no_projector_refuses_images(engine: Any) -> None:
    async with http(engine) as c:
        r = await c.post("/v1/chat/completions", json={"messages": image_message(IMAGE_A)})
    assert r.status_code == 400 and "--mmproj" in r.json()["error"]["message"]


def _llama_server() -> Path | None:
    from importlib.metadata import version

    binary = (Path.home() / ".cache" / "hydra-trio" / "llama-server-build" / "llama_cpp_python-"
              f"{version('llama-cpp-python')}"
              / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server")
    return binary if binary.is_file() else None


async def test_prompt_tokens_match_llama_server(vision_engine: Any, vision_model: Path) -> None:
    binary = _llama_server()
    if binary is None:
        pytest.skip("llama-server is not built (python -m benchmarks --with-llama-server builds it)")
    from hydra_trio.testing.net import free_port

    port = free_port()
    proc = await trio.lowlevel.open_process(
        [str(binary), "-m", str(vision_model), "--mmproj", str(mmproj_path(vision_model)), "--host", "127.0.0.1",
         "--port", str(port), "-c", "2048", "-t", "1", "--no-warmup"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        body = {"messages": image_message(IMAGE_A), "max_tokens": 1, "temperature": 0}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as peer:
            with trio.fail_after(60):
                while True:
                    try:
                        if (await peer.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.2)
            theirs = await peer.post("/v1/chat/completions", json=body)
        async with http(vision_engine) as c:
            ours = await c.post("/v1/chat/completions", json=body)
        assert theirs.status_code == 200, theirs.text
        n_ours, n_theirs = ours.json()["usage"]["prompt_tokens"], theirs.json()["usage"]["prompt_tokens"]
        print(f"prompt_tokens with one {N_IMAGE}-position image: hydra-trio {n_ours}, llama-server {n_theirs}")
        assert n_ours == n_theirs
    finally:
        proc.terminate()
        with trio.move_on_after(30):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
