"""The embedding context: a second llama context on the served model, with embeddings on and
a pooling type, for pooled embeddings (/v1/embeddings) and rank scores (/v1/rerank).

Why not the generation context with ``llama_set_embeddings`` toggled, as llama-server does
(measured: benchmarks/embedding_context.py, docs/performance.md "Embeddings beside
generation"): with embeddings on, llama.cpp outputs every token of a batch (logits, and a
pooled vector for every sequence in it, a generating one's too), so a step that shares a
decode with an input pays for all its rows; a sequence's pooled vector covers only its part
in the last ubatch, and the split KV cache (a stream per slot, the engine's default) cuts a
batch of unequal sequences into such parts (an input beside a step came out at cosine
0.97-0.99 of itself alone; with the unified cache, right); and an input would take a slot and
its KV cells from generation. Here every call is one batch of whole inputs, each its own
sequence in one unified pool emptied after the call: an input never spans two ubatches, and
eight inputs in one decode equal each one alone (cosine 0.9999999). The price is this
context's own KV (``n_batch`` cells) and output buffer (every position's logits and
embedding), allocated once.

Every method runs on the GPU worker. ``normalize`` is pure numpy, as llama.cpp's
``common_embd_normalize``.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np

from .devices import OffloadSettings
from .log import captured

# llama.cpp's pooling types by llama-server's names (--pooling); -1: the model's own.
POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
POOLING_NAMES = {v: k for k, v in POOLING_TYPES.items()}


@dataclass(frozen=True, slots=True)
class PooledShape:
    """What the context computes: its pooling, the floats an input's vector has (``n_out``:
    the model's embedding width, or its rank head's labels), and its limits."""

    pooling: str  # none | mean | cls | last | rank
    n_out: int
    n_batch: int  # tokens per call, the longest input included
    n_seq_max: int  # inputs per call
    labels: tuple[str, ...]  # a rank head's labels (the score is the first's)


class EmbeddingContext:
    """One llama context with embeddings on, emptied after each call."""

    def __init__(
        self, model: llama_cpp.llama_model_p, *, pooling: str | None, n_batch: int, n_seq_max: int,
        n_threads: int, offload: OffloadSettings,
    ) -> None:
        cp = llama_cpp.llama_context_default_params()
        cp.embeddings = True
        cp.pooling_type = -1 if pooling is None else POOLING_TYPES[pooling]
        # One unified pool, one ubatch a call: a pooled vector spans its whole input only
        # when the input is in one ubatch (llama.cpp pools per ubatch).
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq_max
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = offload.flash_attn_type
        cp.offload_kqv = offload.kv_offload
        ctx, ctx_log = captured(lambda: llama_cpp.llama_init_from_model(model, cp))
        if not ctx:
            said = "; ".join(line.strip() for line in ctx_log if "error" in line.lower())
            raise RuntimeError("llama.cpp could not create the embedding context "
                               f"(n_batch={n_batch})" + (f": {said}" if said else ""))
        self._ctx = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)  # NULL for a model without a KV cache (BERT)
        kind = POOLING_NAMES[llama_cpp.llama_pooling_type(ctx)]
        labels: tuple[str, ...] = ()
        if kind == "rank":
            n_cls = max(1, llama_cpp.llama_model_n_cls_out(model))
            labels = tuple(
                (llama_cpp.llama_model_cls_label(model, i) or b"").decode("utf-8", "replace") for i in range(n_cls)
            )
        n_out = len(labels) if kind == "rank" else llama_cpp.llama_model_n_embd_out(model)
        self.shape = PooledShape(kind, n_out, n_batch, n_seq_max, labels)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, n_seq_max)
        self.decode_s = 0.0  # seconds inside llama_decode

    def run(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One decode of ``inputs`` (each its own sequence, all in one ubatch): per input its
        pooled vector (``n_out`` floats), or with pooling none its tokens' vectors (a row each).
        No abort callback: a call serves several requests, and it is one batch of at most
        ``n_batch`` tokens (a Python callback per graph node would cost the trio thread the GIL)."""
        shape = self.shape
        if not inputs or len(inputs) > shape.n_seq_max or sum(map(len, inputs)) > shape.n_batch or not all(inputs):
            raise ValueError(f"an embedding call takes 1..{shape.n_seq_max} "
                             f"non-empty inputs of {shape.n_batch} tokens in all")
        batch = self._batch
        i = 0
        for seq, tokens in enumerate(inputs):
            for pos, token in enumerate(tokens):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = True  # llama.cpp outputs every token with embeddings on
                i += 1
        batch.n_tokens = i
        start = time.perf_counter()
        try:
            rc = llama_cpp.llama_decode(self._ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode of an embedding batch failed with code {rc}")
            return self._read(inputs)
        finally:
            self.decode_s += time.perf_counter() - start
            if self._mem:
                llama_cpp.llama_memory_clear(self._mem, True)

    def _read(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        shape, ctx = self.shape, self._ctx
        if shape.pooling != "none":
            out = []
            for seq in range(len(inputs)):
                ptr = llama_cpp.llama_get_embeddings_seq(ctx, seq)
                if not ptr:
                    raise RuntimeError(f"llama.cpp has no pooled embedding for sequence {seq}")
                out.append(np.ctypeslib.as_array(ptr, shape=(shape.n_out,)).copy())
            return out
        ptr = llama_cpp.llama_get_embeddings(ctx)
        if not ptr:
            raise RuntimeError("llama.cpp has no token embeddings")
        rows = np.ctypeslib.as_array(ptr, shape=(sum(map(len, inputs)), shape.n_out))
        out, at = [], 0
        for tokens in inputs:
            out.append(rows[at : at + len(tokens)].copy())
            at += len(tokens)
        return out

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None


def model_pooling(model: llama_cpp.llama_model_p) -> str | None:
    """The GGUF's own pooling type (``{arch}.pooling_type``): an embedding model's or a
    reranker's; None where it declares none."""
    buf = ctypes.create_string_buffer(64)
    if llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf)) <= 0:
        return None
    n = llama_cpp.llama_model_meta_val_str(model, buf.value + b".pooling_type", buf, len(buf))
    return POOLING_NAMES.get(int(buf.value)) if n > 0 and buf.value.isdigit() else None


def normalize(vector: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's ``common_embd_normalize`` (llama-server's ``embd_normalize``): -1 none, 0
    max-absolute scaled to int16's range, 2 Euclidean (the default), any other p a p-norm;
    an all-zero vector stays zero. Sums in float64, as llama.cpp does."""
    x = vector.astype(np.float64)
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif norm == 2:
        total = float(np.sqrt((x * x).sum()))
    else:
        total = float((np.abs(x) ** norm).sum() ** (1.0 / norm))
    scale = 1.0 / total if total > 0.0 else 0.0
    return (vector * np.float32(scale)).astype(np.float32)
