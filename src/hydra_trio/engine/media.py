"""A chat request's images: OpenAI ``image_url`` parts read into bytes before the prompt is
rendered (data: URIs always; file:// under ``--media-path``; http(s) under a
``--media-url-prefix``; anything else refused, 400), each part replaced by a placeholder the
template prints like text. After rendering, the placeholders found in the prompt, in order,
become the projector's marker and its list of images (``split_images``): a template that
reorders or drops messages takes their images along.

The other dialects (Anthropic ``image`` blocks, Responses ``input_image``) are turned into
``image_url`` parts by their codecs, so this is the one reading of an image for all three.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
import trio

from ..config import Settings
from ..wire.errors import bad_param

# The most bytes one image may have (llama-server reads any; a bound keeps a request's memory
# to what the body cap already allows for data: URIs).
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGES = 16  # per request
FETCH_TIMEOUT_S = 10.0
# Per process and unguessable, as llama-server's media marker: client text that spells a
# placeholder would otherwise claim an image's place.
_NONCE = secrets.token_hex(8)
_PLACEHOLDER = re.compile(rf"<__hydra_image_{_NONCE}_(\d+)__>")


def placeholder(index: int) -> str:
    return f"<__hydra_image_{_NONCE}_{index}__>"


def has_images(body: dict[str, Any]) -> bool:
    """Whether any message of a chat request holds an ``image_url`` part."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
        for m in messages
    )


async def read_images(body: dict[str, Any], settings: Settings) -> tuple[dict[str, Any], list[bytes]]:
    """``body`` with each ``image_url`` part replaced by a text part holding its placeholder,
    and the images' bytes by placeholder index. 400 for a URL that is malformed, not allowed,
    unreadable, or too large."""
    images: list[bytes] = []
    messages = []
    for i, m in enumerate(body["messages"]):
        if not (isinstance(m, dict) and isinstance(m.get("content"), list)):
            messages.append(m)
            continue
        parts = []
        for j, part in enumerate(m["content"]):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{i}].content[{j}].image_url"
                if m.get("role") not in ("user", "system", "developer"):
                    raise bad_param(f"{where}: images go in user messages")
                if len(images) == MAX_IMAGES:
                    raise bad_param(f"{where}: at most {MAX_IMAGES} images a request")
                images.append(await _read(part.get("image_url"), where, settings))
                parts.append({"type": "text", "text": placeholder(len(images) - 1)})
            else:
                parts.append(part)
        messages.append({**m, "content": parts})
    return {**body, "messages": messages}, images


def split_images(prompt: str, images: list[bytes], marker: str) -> tuple[str, list[bytes]]:
    """The rendered prompt with each placeholder the projector's ``marker``, and the images in
    the order the prompt shows them (an image the template did not print is left out)."""
    ordered: list[bytes] = []

    def swap(match: re.Match[str]) -> str:
        ordered.append(images[int(match.group(1))])
        return marker

    return _PLACEHOLDER.sub(swap, prompt), ordered


async def _read(image_url: Any, where: str, settings: Settings) -> bytes:
    url = image_url.get("url") if isinstance(image_url, dict) else image_url  # a bare string: Responses' form
    if not isinstance(url, str) or not url:
        raise bad_param(f"{where}.url must be a non-empty string (a data: URI, or a URL this server may read)")
    if url.startswith("data:"):
        return _data_uri(url, where)
    scheme = urlsplit(url).scheme.lower()
    if scheme == "file":
        return await _file(url, where, settings)
    if scheme in ("http", "https"):
        return await _fetch(url, where, settings)
    raise bad_param(f"{where}.url: {scheme or 'no'} scheme: images come as data: URIs (base64), or file:// and http(s) "
                    "URLs where the server allows them")


def _data_uri(url: str, where: str) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise bad_param(f"{where}.url: a data URI must be data:image/<type>;base64,<data>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad_param(f"{where}.url: an image over {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_param(f"{where}.url: the data URI's payload is not valid base64") from None
    if not data:
        raise bad_param(f"{where}.url: the data URI holds no bytes")
    return data


async def _file(url: str, where: str, settings: Settings) -> bytes:
    if settings.media_path is None:
        raise bad_param(f"{where}.url: file:// URLs are not read by this server (start it with --media-path DIR to "
                        "allow a folder)")
    folder = settings.media_path
    relative = unquote(urlsplit(url).path).lstrip("/")

    def read() -> bytes | None:  # in a thread: path resolution and the read block
        root = os.path.realpath(folder)
        path = os.path.realpath(os.path.join(root, relative))
        if os.path.commonpath([root, path]) != root:
            return None
        with open(path, "rb") as f:
            return f.read(MAX_IMAGE_BYTES + 1)

    try:
        data = await trio.to_thread.run_sync(read)
    except OSError:
        raise bad_param(f"{where}.url: no such file under --media-path") from None
    if data is None:
        raise bad_param(f"{where}.url: outside the --media-path folder")
    if len(data) > MAX_IMAGE_BYTES:
        raise bad_param(f"{where}.url: an image over {MAX_IMAGE_BYTES >> 20} MiB")
    return data


async def _fetch(url: str, where: str, settings: Settings) -> bytes:
    if not any(url.startswith(prefix) for prefix in settings.media_url_prefix):
        raise bad_param(f"{where}.url: http(s) image URLs are not fetched by this server unless a --media-url-prefix "
                        "allows them; send the image as a data: URI")
    try:
        with trio.fail_after(FETCH_TIMEOUT_S):
            async with httpx.AsyncClient(follow_redirects=False) as client, client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise bad_param(f"{where}.url: the image URL answered HTTP {r.status_code}")
                data = bytearray()
                async for piece in r.aiter_bytes():
                    data += piece
                    if len(data) > MAX_IMAGE_BYTES:
                        raise bad_param(f"{where}.url: an image over {MAX_IMAGE_BYTES >> 20} MiB")
                return bytes(data)
    except trio.TooSlowError:
        raise bad_param(f"{where}.url: the image URL did not answer within {FETCH_TIMEOUT_S:g} s") from None
    except httpx.HTTPError as exc:
        raise bad_param(f"{where}.url: the image could not be fetched ({type(exc).__name__})") from None
