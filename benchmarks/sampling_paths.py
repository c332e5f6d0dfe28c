"""Where a greedy token is picked, and what it costs outside ``llama_decode`` (issue 53,
Deliver 3's evidence): on the bare llama.cpp API, the same greedy loop at 1 and 8 sequences,
the token picked three ways, side by side in one process, round after round:

- ``numpy``: the engine's path today: the step's logits as one NumPy view of llama.cpp's
  buffer (``llama_get_logits``), then ``argmax`` of each row (engine/sample/sampler.py: ``Sampler.is_argmax``);
- ``chain``: llama.cpp's own host sampler, ``llama_sampler_sample`` with a greedy chain on
  the context's logits (it builds an n_vocab candidate array per token);
- ``backend``: llama.cpp's backend sampling (``llama_set_sampler`` per sequence: the chain
  runs in the model's graph, on the device that computes the output layer), the token read
  with ``llama_get_sampled_token_ith``; no logits reach the host.

    python -m benchmarks.sampling_paths [--model gemma|tiny|PATH] [--tokens 64] [--rounds 3]
        [--seqs 1,8] [--threads 1]

Per path and sequence count: llama_decode's time per step, the time outside it per token
(the batch written, the pick, the loop), and whether the tokens equal numpy's (greedy: they
must, but for exact ties). Each path runs on its own context (backend samplers are attached
when the context is made), the paths' order turning each round.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

PATHS = ("numpy", "chain", "backend")


class Loop:
    """One context, ``n_seq`` sequences, a greedy loop picking the token by ``path``."""

    def __init__(self, model: Any, path: str, n_seq: int, threads: int, n_ctx: int) -> None:
        self.path = path
        self.n_seq = n_seq
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = -(-n_ctx // 256) * 256 * n_seq  # whole 256-cell streams: no rounding notice
        cp.n_batch = cp.n_ubatch = max(512, n_seq)
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = threads
        self.chains = []
        if path in ("chain", "backend"):
            for _ in range(n_seq):
                chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
                self.chains.append(chain)
        if path == "backend":
            configs = (llama_cpp.llama_sampler_seq_config * n_seq)()
            for i, chain in enumerate(self.chains):
                configs[i].seq_id = i
                configs[i].sampler = ctypes.cast(chain, ctypes.c_void_p)
            cp.samplers = configs
            cp.n_samplers = n_seq
            self._configs = configs  # kept alive with the context
        self.ctx = llama_cpp.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError(f"{path}: context creation failed")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(max(512, n_seq), 0, n_seq)
        self.decode_s = 0.0
        self.outside_s = 0.0
        self.tokens: list[list[int]] = [[] for _ in range(n_seq)]

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (seq, tok, pos, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self.ctx, b)
        self.decode_s += time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"llama_decode: {rc}")

    def _pick(self, n_rows: int) -> list[int]:
        if self.path == "numpy":
            ptr = llama_cpp.llama_get_logits(self.ctx)
            rows = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))
            return [int(rows[j].argmax()) for j in range(n_rows)]
        if self.path == "chain":
            return [llama_cpp.llama_sampler_sample(self.chains[j], self.ctx, j) for j in range(n_rows)]
        out = []
        for j in range(n_rows):
            tok = llama_cpp.llama_get_sampled_token_ith(self.ctx, j)
            llama_cpp.llama_sampler_accept(self.chains[j], tok)
            out.append(tok)
        return out

    def run(self, prompts: list[list[int]], n_tokens: int) -> None:
        mem = llama_cpp.llama_get_memory(self.ctx)
        llama_cpp.llama_memory_clear(mem, True)
        for seq, p in enumerate(prompts):  # each prompt alone, its last position's row read
            self._decode([(seq, t, i, i == len(p) - 1) for i, t in enumerate(p)])
            self.tokens[seq] = [self._pick_one()]
        pos = [len(p) for p in prompts]
        self.decode_s = self.outside_s = 0.0
        t_start = time.perf_counter()
        for _ in range(n_tokens - 1):
            entries = [(s, self.tokens[s][-1], pos[s], True) for s in range(self.n_seq)]
            self._decode(entries)
            for s, tok in enumerate(self._pick(self.n_seq)):
                self.tokens[s].append(tok)
                pos[s] += 1
        self.outside_s = time.perf_counter() - t_start - self.decode_s

    def _pick_one(self) -> int:
        if self.path == "numpy":
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            return int(row.argmax())
        if self.path == "chain":
            return int(llama_cpp.llama_sampler_sample(self.chains[0], self.ctx, -1))
        return int(llama_cpp.llama_get_sampled_token_ith(self.ctx, -1))

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        for chain in self.chains:
            llama_cpp.llama_sampler_free(chain)


def model_path(name: str) -> str:
    if name == "gemma":
        from hydra_trio.model.registry import named_model_path

        return str(named_model_path("gemma3-270m"))
    if name == "tiny":
        from .__main__ import build_models

        cache = Path.home() / ".cache" / "hydra-trio" / "bench"
        cache.mkdir(parents=True, exist_ok=True)
        return build_models(cache, ["tiny"])["tiny"]
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sampling_paths", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from hydra_trio.engine.llama.log import init_llama

    init_llama()  # llama.cpp's log routed to Python logging (quiet), the backend initialised
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(model_path(args.model).encode(), mp)
    vocab = llama_cpp.llama_model_get_vocab(model)
    print(f"model {args.model}: n_vocab {llama_cpp.llama_vocab_n_tokens(vocab)}")
    for n_seq in (int(x) for x in args.seqs.split(",")):
        loops = {p: Loop(model, p, n_seq, args.threads, 64 + args.tokens + 16) for p in PATHS}
        rows: dict[str, list[tuple[float, float]]] = {p: [] for p in PATHS}
        try:
            for rnd in range(args.rounds + 1):
                prompts = [[1 + (rnd * 31 + s * 7 + k * 13) % 1000 for k in range(24)] for s in range(n_seq)]
                order = PATHS[rnd % 3:] + PATHS[: rnd % 3]
                for p in order:
                    loop = loops[p]
                    loop.run(prompts, args.tokens)
                    if rnd:
                        made = n_seq * (args.tokens - 1)
                        rows[p].append((loop.decode_s / (args.tokens - 1) * 1e3, loop.outside_s / made * 1e6))
                same = {p: loops[p].tokens == loops["numpy"].tokens for p in PATHS}
                if rnd:
                    print(f"{n_seq} seq round {rnd}: " + ", ".join(
                        f"{p} decode {rows[p][-1][0]:.2f} ms/step, outside {rows[p][-1][1]:.1f} us/token"
                        + ("" if same[p] else " (tokens differ)") for p in PATHS), flush=True)
        finally:
            for loop in loops.values():
                loop.close()
        for p in PATHS:
            dec = statistics.median(r[0] for r in rows[p])
            out = statistics.median(r[1] for r in rows[p])
            print(f"{n_seq} seq {p:8s}: llama_decode {dec:.2f} ms a step, outside it {out:.1f} us a token (median of "
                  f"{len(rows[p])})")
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
