"""`python -m benchmarks.repack [--rounds N] [--threads N] [--prompt N] [--gen N]`

What repacking weights (``--repack``, llama.cpp's CPU "extra buffer types") buys on this
machine, per weight type: Q4_K (Gemma 3 270M Q4_K_M, when its package is installed, and the
bench preset quantized to Q4_K_M), Q8_0 and F16 (the bench preset). Each round loads the
model both ways, back to back, and times a prompt (one batch) and single-token steps through
the engine's own backend; the ratio of the two is taken within the round.

Run it on a CPU without AMX: with AMX, llama.cpp's AMX kernels crash on repacked weights
(ggml-org/llama.cpp#20824), which is why the engine's default turns repacking off there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# llama_ftype values (llama.h) for llama_model_quantize.
_FTYPES = {"Q8_0": 7, "Q4_K_M": 15}


def _bench_models(cache: Path) -> dict[str, Path]:
    """The bench preset in F16, and quantized from it to Q8_0 and Q4_K_M (written once)."""
    import llama_cpp

    from hydra_trio.model.synthetic import write_model

    cache.mkdir(parents=True, exist_ok=True)
    f16 = cache / "bench.gguf"
    if not f16.exists():
        write_model(f16, "bench", seed=0)
    models = {"F16 (bench)": f16}
    for name, ftype in _FTYPES.items():
        out = cache / f"bench-{name.lower()}.gguf"
        if not out.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params)
            if rc != 0:
                raise RuntimeError(f"quantizing to {name} failed ({rc})")
        models[f"{name} (bench)"] = out
    return models


def _time_one(path: Path, *, repack: bool, threads: int, n_prompt: int, n_gen: int) -> dict[str, float]:
    from hydra_trio.engine.llama.context import LlamaBackend
    from hydra_trio.engine.llama.devices import OffloadSettings

    backend = LlamaBackend(
        str(path), n_slots=1, n_ctx=1024, n_threads=threads, n_batch=512,
        offload=OffloadSettings(repack=repack, n_gpu_layers=0),
    )
    try:
        assert backend.model_params_applied["use_extra_bufts"] is repack
        backend.warmup()
        tokens = [(7 * i + 11) % backend.info.n_vocab for i in range(n_prompt)]
        t0 = time.perf_counter()
        backend.eval_chunk(0, tokens, None)
        t1 = time.perf_counter()
        for i in range(n_gen):
            backend.eval_chunk(0, [(3 * i + 5) % backend.info.n_vocab], None)
        t2 = time.perf_counter()
    finally:
        backend.close()
    return {"prompt_tok_s": n_prompt / (t1 - t0), "gen_tok_s": n_gen / (t2 - t1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.repack")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (one batch)")
    ap.add_argument("--gen", type=int, default=64, help="single-token steps")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hydra-trio" / "bench-models")
    ap.add_argument("--out", type=Path, default=RESULTS / "repack.json")
    args = ap.parse_args(argv)

    from hydra_trio.engine.llama.devices import AMX_CPU_FLAGS, cpu_flags
    from hydra_trio.model.registry import ModelPackageMissing, named_model_path

    amx = [f for f in AMX_CPU_FLAGS if f in cpu_flags()]
    if amx:
        print(f"this CPU has AMX ({' '.join(amx)}): repacked runs would crash here; run this elsewhere")
        return 2
    models: dict[str, Path] = {}
    try:
        models["Q4_K_M (gemma3-270m)"] = named_model_path("gemma3-270m")
    except ModelPackageMissing as exc:
        print(f"skipping Gemma: {exc}")
    models.update(_bench_models(args.cache))

    results: dict[str, Any] = {"threads": args.threads, "prompt": args.prompt, "gen": args.gen, "models": {}}
    print(f"{'weights':24} {'prompt tok/s off → on':>26} {'ratio':>7}   {'step tok/s off → on':>22} {'ratio':>7}")
    for name, path in models.items():
        rounds = []
        for _ in range(args.rounds):
            off = _time_one(path, repack=False, threads=args.threads, n_prompt=args.prompt, n_gen=args.gen)
            on = _time_one(path, repack=True, threads=args.threads, n_prompt=args.prompt, n_gen=args.gen)
            rounds.append({"off": off, "on": on,
                           "prompt_ratio": on["prompt_tok_s"] / off["prompt_tok_s"],
                           "gen_ratio": on["gen_tok_s"] / off["gen_tok_s"]})
        med = {k: statistics.median(r[k] for r in rounds) for k in ("prompt_ratio", "gen_ratio")}
        p_off = statistics.median(r["off"]["prompt_tok_s"] for r in rounds)
        p_on = statistics.median(r["on"]["prompt_tok_s"] for r in rounds)
        g_off = statistics.median(r["off"]["gen_tok_s"] for r in rounds)
        g_on = statistics.median(r["on"]["gen_tok_s"] for r in rounds)
        spread_p = f"[{min(r['prompt_ratio'] for r in rounds):.2f}-{max(r['prompt_ratio'] for r in rounds):.2f}]"
        spread_g = f"[{min(r['gen_ratio'] for r in rounds):.2f}-{max(r['gen_ratio'] for r in rounds):.2f}]"
        print(f"{name:24} {p_off:>10.0f} → {p_on:<10.0f} {med['prompt_ratio']:>5.2f}× {spread_p}"
              f"   {g_off:>7.1f} → {g_on:<7.1f} {med['gen_ratio']:>5.2f}× {spread_g}", flush=True)
        results["models"][name] = {"rounds": rounds, "median": med}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
