"""How llama.cpp computes pooled embeddings beside generation (issue 51): the measurements
behind the embedding context's design (engine/llama/embedding.py), on llama.cpp directly.

    python -m benchmarks.embedding_context [--preset small] [--repeats 5]

1. A dedicated context (embeddings on, one unified pool, emptied after each call): eight
   inputs in one decode against each alone (cosine).
2. The generation context with ``llama_set_embeddings`` toggled on, a generation step of one
   slot and an embedding input of another in one batch, with the split KV cache (a stream per
   slot, the engine's default) and the unified one: the input's pooled vector against the
   dedicated context's, and how many rows of logits the batch produced.
3. The compute of one embedding call: a unified pool against a stream per input, and a decode
   per input, as CPU seconds of the calling thread (one llama thread: the machine's load moves
   the wall time, far less the CPU time).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable, Sequence

import llama_cpp as L
import numpy as np

from hydra_trio.model import synthetic

_quiet = L.llama_log_callback(lambda *_: None)  # kept: ctypes callbacks are collected otherwise


def context(
    model: L.llama_model_p, *, embeddings: bool, unified: bool, n_seq: int, n_ctx: int, n_batch: int = 512
) -> L.llama_context_p:
    cp = L.llama_context_default_params()
    cp.embeddings = embeddings
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
    cp.kv_unified = unified
    cp.n_threads = cp.n_threads_batch = 1
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "llama.cpp could not make the context"
    return ctx


def decode(ctx: L.llama_context_p, entries: Sequence[tuple[int, int, int, bool]]) -> float:
    """One llama_decode of (seq, token, pos, output) entries; the thread's CPU seconds."""
    batch = L.llama_batch_init(len(entries), 0, 64)
    for i, (seq, token, pos, out) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, out
        batch.seq_id[i][0] = seq
    batch.n_tokens = len(entries)
    t0 = time.thread_time()
    try:
        assert L.llama_decode(ctx, batch) == 0
        return time.thread_time() - t0
    finally:
        L.llama_batch_free(batch)


def pooled(ctx: L.llama_context_p, seq: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array(L.llama_get_embeddings_seq(ctx, seq), shape=(n,)).copy()


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    path = synthetic.cache_dir() / f"hydra-bench-embed-{args.preset}-v{synthetic.SYNTHETIC_FORMAT_VERSION}.gguf"
    if not path.exists():
        synthetic.write_model(path, args.preset, pooling="mean", name="Hydra Bench Embed")
    L.llama_log_set(_quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    n_embd, n_vocab = L.llama_model_n_embd(model), L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rng = np.random.default_rng(0)
    inputs = [[int(t) for t in rng.integers(300, n_vocab, 24 + 9 * i)] for i in range(8)]

    # 1. the dedicated context
    ded = context(model, embeddings=True, unified=True, n_seq=32, n_ctx=512)
    mem = L.llama_get_memory(ded)

    def embed(seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        decode(ded, [(s, t, i, True) for s, toks in enumerate(seqs) for i, t in enumerate(toks)])
        out = [pooled(ded, s, n_embd) for s in range(len(seqs))]
        L.llama_memory_clear(mem, True)
        return out

    alone = [embed([x])[0] for x in inputs]
    together = embed(inputs)
    print("1. dedicated context, 8 inputs in one decode against each alone: min cosine "
          f"{min(map(cos, alone, together)):.7f}")

    # 2. the generation context, embeddings toggled on for a mixed batch
    for unified in (False, True):
        gen = context(model, embeddings=False, unified=unified, n_seq=4, n_ctx=4096)
        prompt = inputs[0][:16]
        decode(gen, [(0, t, i, i == len(prompt) - 1) for i, t in enumerate(prompt)])
        L.llama_set_embeddings(gen, True)
        entries = [(0, prompt[-1], len(prompt), True)] + [(1, t, i, True) for i, t in enumerate(inputs[1])]
        decode(gen, entries)
        rows = sum(1 for i in range(len(entries)) if L.llama_get_logits_ith(gen, i))
        got = pooled(gen, 1, n_embd)
        print(f"2. generation context ({'unified' if unified else 'split'} KV), a step and an input in one batch, "
              "embeddings on: "
              f"the input's vector at cosine {cos(got, alone[1]):.7f} "
              f"of its own; {rows} of {len(entries)} rows have logits; "
              f"the generating slot got a pooled vector too: {L.llama_get_embeddings_seq(gen, 0) is not None}")
        L.llama_free(gen)

    # 3. compute of one call
    split = context(model, embeddings=True, unified=False, n_seq=8, n_ctx=512 * 8)

    def timed(fn: Callable[[], float]) -> float:
        fn()
        return statistics.median(fn() for _ in range(args.repeats))

    def one_call(ctx: L.llama_context_p) -> float:
        t = decode(ctx, [(s, t, i, True) for s, toks in enumerate(inputs) for i, t in enumerate(toks)])
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        return t

    def per_input() -> float:
        total = 0.0
        for x in inputs:
            total += decode(ded, [(0, t, i, True) for i, t in enumerate(x)])
            L.llama_memory_clear(mem, True)
        return total

    uni_s, split_s, each_s = timed(lambda: one_call(ded)), timed(lambda: one_call(split)), timed(per_input)
    n_tok = sum(map(len, inputs))
    print(f"3. {len(inputs)} inputs, {n_tok} tokens, CPU ms: one decode in a unified pool {uni_s * 1e3:.0f}, "
          f"in a stream each {split_s * 1e3:.0f} ({split_s / uni_s:.3f}x), a decode per input {each_s * 1e3:.0f} "
          f"({each_s / uni_s:.3f}x)")


if __name__ == "__main__":
    main()
