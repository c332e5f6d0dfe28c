"""Image input through llama.cpp's mtmd (llama-server's ``--mmproj``): the projector, a chat
prompt with images tokenized into text tokens and image positions, and an image's positions
evaluated into a slot's sequence.

An image's positions stand in a prompt's token list as negative ids, one per position, each
30 bits of a hash of the image's SHA-256 (mtmd's bitmap id) and the position: the token list
is the KV's identity as for text. A cached prefix matches an image only when every one of its
positions agrees (30 bits a position: a 16-position image is 480 bits), so two different
images never share a cached prefix (nor a KV block's hash), the same image in the same place
reuses it, and nothing that compares, hashes or stores token lists needs to know about
images. An image's first id is marked (its lowest bit set), so a span is read from the list
alone: it ends at the next text token or the next image's first position. No vocabulary id is
negative, so an image's id is never fed to llama_decode as a token: the engine evaluates
image spans here (``eval_image``), whole.

Every method runs on the GPU worker, as every llama.cpp call does.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd

from .log import captured, route_mtmd_log
from .types import ImageError, image_ids

log = logging.getLogger(__name__)

# Images whose encoded chunks stay known (a prompt's images are tokenized before its slot is
# claimed and evaluated after: this is how many may wait in between). Each holds its
# preprocessed pixels (a few MB for a large model's image size).
MAX_HELD_IMAGES = 64
_CHUNK_TEXT, _CHUNK_IMAGE = 0, 1  # mtmd_input_chunk_type


class Projector:
    """mtmd's context for one model and its projector file."""

    def __init__(self, model: ctypes.c_void_p, path: str, *, n_threads: int, use_gpu: bool) -> None:
        route_mtmd_log()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = True  # one encode at load: a projector that faults does so at start
        # A marker no client text is likely to hold (llama-server's is random per process too):
        # text that holds it would claim an image position.
        self.marker = f"<__media_{secrets.token_hex(8)}__>"
        self._marker_bytes = self.marker.encode()
        params.media_marker = self._marker_bytes
        self._ctx, said = captured(lambda: mtmd.mtmd_init_from_file(path.encode(), model, params))
        if not self._ctx:
            why = "; ".join(
                line.strip()
                for line in said
                if "error" in line.lower() or "mismatch" in line.lower() or "failed" in line.lower()
            )
            raise RuntimeError(f"mtmd could not load the projector {path!r}" + (f": {why}" if why else ""))
        if not mtmd.mtmd_support_vision(self._ctx):
            self.close()
            raise RuntimeError(f"{path!r}: the projector has no vision encoder (audio input is not served)")
        if mtmd.mtmd_decode_use_mrope(self._ctx):
            self.close()
            raise RuntimeError(f"{path!r}: a projector with M-RoPE positions (Qwen2-VL and kin) is not served yet")
        self.path = path
        # An image's first id -> (all its ids, its chunk: a copy we own)
        self._chunks: OrderedDict[int, tuple[tuple[int, ...], ctypes.c_void_p]] = OrderedDict()
        self.encode_s = 0.0

    def close(self) -> None:
        for _, chunk in self._chunks.values():
            mtmd.mtmd_input_chunk_free(chunk)
        self._chunks.clear()
        if self._ctx:
            mtmd.mtmd_free(self._ctx)
            self._ctx = None

    def tokenize(self, text: str, images: Sequence[bytes]) -> tuple[list[int], int]:
        """``text`` (one ``marker`` per image, in order) and the images -> the prompt's token
        list (text tokens, each image's id once per position) and its image positions.
        Text is tokenized as llama-server's mtmd prompts are (special tokens added and
        parsed). ImageError: an image that does not decode, or markers that do not match."""
        bitmaps = []
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            for i, data in enumerate(images):
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
                if not bitmap:
                    raise ImageError(f"image {i + 1} of the request could not be decoded (PNG, JPEG, GIF, BMP, ... as "
                                     "stb_image reads them)")
                bitmaps.append(bitmap)
                if mtmd.mtmd_bitmap_is_audio(bitmap):
                    raise ImageError(f"image {i + 1} of the request is audio, not an image")
                # The id the KV is known by: the image's bytes (the helper sets a SHA-256 too).
                mtmd.mtmd_bitmap_set_id(bitmap, hashlib.sha256(data).hexdigest().encode())
            raw = text.encode("utf-8")
            inp = mtmd.mtmd_input_text(raw, len(raw), True, True)
            arr = (mtmd.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc == 1:
                raise ImageError(f"the prompt's image markers do not match its {len(images)} images")
            if rc != 0:
                raise ImageError(f"the images could not be preprocessed (mtmd_tokenize: {rc})")
            tokens: list[int] = []
            n_image = 0
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                kind = mtmd.mtmd_input_chunk_get_type(chunk)
                if kind == _CHUNK_TEXT:
                    n = ctypes.c_size_t(0)
                    ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    tokens.extend(ptr[: n.value])
                elif kind == _CHUNK_IMAGE:
                    digest = (mtmd.mtmd_input_chunk_get_id(chunk) or b"").decode()
                    n = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                    ids = image_ids(digest, n)
                    self._hold(ids, chunk)
                    tokens.extend(ids)
                    n_image += n
                else:
                    raise ImageError("audio chunks are not served")
            return tokens, n_image
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _hold(self, ids: tuple[int, ...], chunk: ctypes.c_void_p) -> None:
        held = self._chunks.get(ids[0])
        if held is not None and held[0] == ids:
            self._chunks.move_to_end(ids[0])
            return
        copy = mtmd.mtmd_input_chunk_copy(chunk)
        if not copy:
            raise MemoryError("mtmd could not copy an image chunk")
        if held is not None:  # another image with the same first id (1 in 2**30): the newer one is held
            mtmd.mtmd_input_chunk_free(held[1])
        self._chunks[ids[0]] = (ids, copy)
        self._chunks.move_to_end(ids[0])
        while len(self._chunks) > MAX_HELD_IMAGES:
            _, (_, old) = self._chunks.popitem(last=False)
            mtmd.mtmd_input_chunk_free(old)

    def eval_image(self, lctx: ctypes.c_void_p, ids: Sequence[int], n_past: int, seq: int, n_batch: int) -> int:
        """Encode the image whose positions' ids are ``ids`` and decode its embeddings into
        sequence ``seq`` at ``n_past``; returns the positions it took. KeyError: the image is
        no longer held (more than MAX_HELD_IMAGES others came between its tokenizing and its
        turn)."""
        held = self._chunks.get(ids[0])
        if held is None or held[0] != tuple(ids):
            raise KeyError(ids[0])
        chunk = held[1]
        self._chunks.move_to_end(ids[0])
        new_n_past = llama_cpp.llama_pos(0)
        start = time.perf_counter()
        rc = mtmd.mtmd_helper_eval_chunk_single(
            self._ctx, lctx, chunk, n_past, seq, n_batch, False, ctypes.byref(new_n_past)
        )
        self.encode_s += time.perf_counter() - start
        if rc != 0:
            raise RuntimeError(f"mtmd could not evaluate an image (mtmd_helper_eval_chunk_single: {rc})")
        return int(new_n_past.value) - n_past
