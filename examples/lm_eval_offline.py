"""lm-eval's ``local-completions`` model against `hydra-trio serve`, offline.

Two tasks from local files (no dataset download): ``hydra_mc``, a multiple-choice task lm-eval
scores by loglikelihood (its requests: ``echo: true, logprobs: 1, max_tokens: 1`` on token
ids), and ``hydra_gen``, a generation task (``generate_until`` with a stop string). The
tokenizer is the engine's own (``tokenizer_backend=remote``: GET /tokenizer_info, POST
/tokenize and /detokenize), so nothing comes from the Hugging Face hub.

    pip install 'lm-eval[api]'        # no torch; its own environment is fine
    python examples/lm_eval_offline.py [--model GGUF] [--lm-eval PATH] [--capture FILE]

``--lm-eval``: the ``lm_eval`` command (default: the one on PATH, else next to this Python).
``--capture FILE``: every request lm-eval sends goes through a recording proxy and lands in
FILE as JSON (tests/http/test_evals.py replays such a capture). Without ``--model``, a synthetic
tiny model is written first (its scores mean nothing; the point is that the run completes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from hydra_trio.testing.net import free_port
from hydra_trio.testing.process import EngineProcess

DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "label": 0, "answer": "blue"},
    {"question": "Water freezes when it is", "choices": ["cold", "hot", "late"], "label": 0, "answer": "cold"},
    {"question": "Two plus two is", "choices": ["three", "four", "five"], "label": 1, "answer": "four"},
    {"question": "A cat says", "choices": ["meow", "moo", "quack"], "label": 0, "answer": "meow"},
]

MC_TASK = """task: hydra_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""

GEN_TASK = """task: hydra_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    data = folder / "hydra_eval.json"
    data.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    (folder / "hydra_mc.yaml").write_text(MC_TASK.format(data=data))
    (folder / "hydra_gen.yaml").write_text(GEN_TASK.format(data=data))


@contextmanager
def recording_proxy(target: str, capture: list[dict[str, Any]]) -> Iterator[str]:
    """A loopback proxy to ``target`` that appends every request (method, path, JSON body)
    to ``capture``; yields its base URL."""
    client = httpx.Client(base_url=target, timeout=600)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(raw) if raw else None
            with lock:
                capture.append({"method": self.command, "path": self.path, "body": body})
            r = client.request(self.command, self.path, content=raw or None,
                               headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
            self.send_response(r.status_code)
            self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
            self.send_header("Content-Length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        do_GET = do_POST = _forward

        def log_message(self, *_args: Any) -> None:  # quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        client.close()


def lm_eval_command(given: str | None) -> str:
    found = given or shutil.which("lm_eval") or str(Path(sys.executable).with_name("lm_eval"))
    if not Path(found).exists() and shutil.which(found) is None:
        raise SystemExit(f"lm_eval not found ({found}): pip install 'lm-eval[api]', or pass --lm-eval PATH")
    return found


def run(args: argparse.Namespace) -> int:
    lm_eval = lm_eval_command(args.lm_eval)
    with tempfile.TemporaryDirectory(prefix="hydra-lm-eval-") as tmp:
        folder = Path(tmp)
        write_tasks(folder)
        model = args.model
        if model is None:
            from hydra_trio.model.synthetic import write_model

            model = str(write_model(folder / "tiny.gguf", "tiny", seed=0))
        engine = EngineProcess(model, slots=2, ctx_size=4096, threads=args.threads).start(folder, "engine")
        capture: list[dict[str, Any]] = []
        try:
            with recording_proxy(engine.url, capture) if args.capture else _direct(engine.url) as base:
                model_args = ",".join([
                    "model=hydra", f"base_url={base}/v1/completions", "tokenizer_backend=remote",
                    "tokenized_requests=True", "num_concurrent=1", "max_retries=1", "max_length=2048",
                ])
                env = {
                    **os.environ,
                    "HF_DATASETS_OFFLINE": "1",
                    "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                }
                cmd = [lm_eval, "--model", "local-completions", "--model_args", model_args,
                       "--tasks", "hydra_mc,hydra_gen", "--include_path", str(folder),
                       "--output_path", str(folder / "results"), "--log_samples"]
                print("$", " ".join(cmd), flush=True)
                done = subprocess.run(cmd, env=env, cwd=folder, timeout=args.timeout_s)
        finally:
            engine.stop()
        if args.capture:
            Path(args.capture).write_text(json.dumps({"requests": capture}, indent=1) + "\n")
            print(f"captured {len(capture)} requests to {args.capture}")
        results = sorted((folder / "results").rglob("results_*.json"))
        if done.returncode == 0 and results:
            scores = json.loads(results[-1].read_text())["results"]
            print(
                json.dumps({task: {k: v for k, v in r.items() if k != "alias"} for task, r in scores.items()}, indent=1)
            )
        return done.returncode


@contextmanager
def _direct(url: str) -> Iterator[str]:
    yield url


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF to serve (default: a synthetic tiny model)")
    p.add_argument("--lm-eval", default=None, help="the lm_eval command (default: on PATH, else beside this Python)")
    p.add_argument("--capture", default=None, help="record lm-eval's requests to this JSON file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=900.0)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
