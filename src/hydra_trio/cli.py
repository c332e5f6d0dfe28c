"""Command line: `hydra-trio serve | make-model | identity | settings | info | prefill | decode |
result | cancel`."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import resource
import signal
import sys
from collections.abc import Collection, Iterator

import trio

from .config import Settings, add_arguments, settings_from, settings_table


class _ToolCallParsers(Collection[str]):
    """--tool-call-parser's words: auto and the engine's tool-call families (their roster,
    engine/chat/families/), read when argparse first checks or lists them, or a setting is
    validated: the commands that never serve do not load the engine to build their parser."""

    def _words(self) -> tuple[str, ...]:
        from .engine import TOOL_CALL_PARSERS

        return TOOL_CALL_PARSERS

    def __contains__(self, word: object) -> bool:
        return word in self._words()

    def __iter__(self) -> Iterator[str]:
        return iter(self._words())

    def __len__(self) -> int:
        return len(self._words())


# The settings' words this layer decides (config/ is below the engine).
CHOICES = {"tool_call_parser": _ToolCallParsers()}


async def _serve_until_signal(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM; then drain (a second signal stops now): the front ends
    keep answering, new work is refused (HTTP 503 with Retry-After, RPC BUSY, /health
    "draining"), and what runs (chats, completions, DECODEs, exports not yet pulled) gets
    --shutdown-grace-s to finish."""
    from .app import serve
    from .serving import AppState, Endpoints

    log = logging.getLogger("hydra_trio")
    endpoints: Endpoints | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if endpoints is None:
                        log.info("received %s during startup: stopping", name)
                        break
                    state = endpoints.state
                    grace = settings.shutdown_grace_s
                    state.begin_drain()
                    log.info(
                        "received %s: draining (%s; up to %.0f s; signal again to stop now)",
                        name, state.in_flight() or "nothing in flight", grace,
                    )
                    async with trio.open_nursery() as drain:

                        async def wait_drained(state: AppState = state, grace: float = grace) -> None:
                            with trio.move_on_after(grace):
                                await state.wait_drained()
                            left = state.in_flight()
                            if left:
                                log.warning("drain: %.0f s are up, stopping what still runs (%s)", grace, left)
                            drain.cancel_scope.cancel()

                        drain.start_soon(wait_drained)
                        async for _ in signals:  # a second signal: stop without waiting
                            drain.cancel_scope.cancel()
                    break
                nursery.cancel_scope.cancel()  # what still runs is cancelled as the engine stops

            async def on_dump_signals() -> None:
                # SIGUSR1: what every task waits on and every thread runs, for a hang.
                from .observability import dump_lines

                with trio.open_signal_receiver(signal.SIGUSR1) as dumps:
                    async for _ in dumps:
                        now = "nothing in flight" if endpoints is None else endpoints.state.in_flight()
                        lines = dump_lines()
                        log.warning("SIGUSR1: %s; what runs now (%d lines):", now or "nothing in flight", len(lines))
                        for line in lines:  # a record each: the log's escaping keeps each one line
                            log.warning("| %s", line)

            nursery.start_soon(on_signals)
            nursery.start_soon(on_dump_signals)
            endpoints = await nursery.start(serve, settings)
    log.info("stopped")


def raise_file_limit() -> tuple[int, int]:
    """Raise the soft limit on open descriptors to the hard one (a soft 1,024, a common
    default, let ~1,000 idle HTTP connections make accept fail with EMFILE and take /health
    down); returns (soft before, soft now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from(args, choices=CHOICES)
    from .observability import configure_logging

    configure_logging(settings)  # --log-level, --log-format, --log-requests
    before, now = raise_file_limit()
    logging.getLogger("hydra_trio").info("open-file limit: %d (soft limit was %d)", now, before)
    try:
        trio.run(_serve_until_signal, settings)
    except BaseExceptionGroup as group:
        # Startup failures (port in use, unreadable model) get one clear line, not a trace.
        from .concurrency import leaves

        errors = leaves(group)
        for exc in errors:
            if isinstance(exc, SystemExit):
                print(f"hydra-trio: {exc}", file=sys.stderr)
                return 2
        if all(isinstance(exc, OSError | ValueError | RuntimeError) for exc in errors):
            for exc in errors:
                print(f"hydra-trio: cannot start: {exc}", file=sys.stderr)
            return 1
        raise
    return 0


def _kv_pair(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value: object = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        try:
            value = int(raw)
        except ValueError:
            pass
    return key, value


def cmd_make_model(args: argparse.Namespace) -> int:
    if args.lora is not None:
        return _make_lora_adapter(args)
    if args.preset == "vision":
        return _make_vision_model(args)
    from .model.synthetic import write_model

    try:
        path = write_model(
            args.out,
            args.preset,
            seed=args.seed,
            name=args.name,
            base_model_name=args.base_model,
            tags=args.tag or (),
            tokenizer_pre=args.tokenizer_pre,
            extra_kv=dict(args.kv or []),
            pooling=args.pooling,
        )
    except ValueError as exc:
        print(f"make-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _make_vision_model(args: argparse.Namespace) -> int:
    from .model.synthetic_vision import write_vision_model

    model, proj = write_vision_model(args.out, seed=args.seed)
    print(model)
    print(proj)
    return 0


def _make_lora_adapter(args: argparse.Namespace) -> int:
    from .model.synthetic_lora import write_lora_adapter

    try:
        path = write_lora_adapter(
            args.lora, args.out, seed=args.seed, rank=args.lora_rank, alpha=args.lora_alpha, name=args.name
        )
    except (OSError, ValueError) as exc:
        print(f"make-model --lora {args.lora}: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _rpc_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def _request(args: argparse.Namespace) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": args.message}], "max_tokens": args.max_tokens}


def cmd_info(args: argparse.Namespace) -> int:
    from .rpc.client import SyncRpcClient

    with SyncRpcClient(*args.rpc) as c:
        print(json.dumps(c.info().meta, indent=2))
    return 0


def cmd_prefill(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .rpc.client import SyncRpcClient

    with SyncRpcClient(*args.rpc) as c:
        resp = c.prefill(args.slot, _request(args))
    Path(args.out).write_bytes(resp.payload)
    print(json.dumps({**resp.meta, "blob": args.out, "blob_bytes": len(resp.payload)}, indent=2))
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .rpc.client import SyncRpcClient, build_decode_frame, identity_kv_metadata

    kv = Path(args.kv).read_bytes() if args.kv else b""
    kv_meta = {}
    if args.kv_meta:
        meta = json.loads(Path(args.kv_meta).read_text())
        kv_meta = identity_kv_metadata(meta, meta.get("n_past", 0))
    frame = build_decode_frame(_request(args), kv, kv_metadata=kv_meta)
    with SyncRpcClient(*args.rpc) as c:
        print(json.dumps(c.decode(args.slot, frame).meta, indent=2))
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    import httpx

    from .transport import auth_headers

    url = f"{args.http}/v1/decode/{args.id}"
    auth = auth_headers(args.api_key)
    if args.stream:
        with httpx.stream("GET", url, headers={"Accept": "text/event-stream", **auth}, timeout=None) as resp:
            if resp.status_code != 200:
                resp.read()
                print(json.dumps(resp.json(), indent=2))
                return 1
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices") or [{}]
                    print(choices[0].get("delta", {}).get("content") or "", end="", flush=True)
        print()
        return 0
    resp = httpx.get(url, params={"wait": args.wait}, headers=auth, timeout=args.wait + 30)
    print(json.dumps(resp.json(), indent=2))
    return 0 if resp.status_code == 200 else 1


def cmd_cancel(args: argparse.Namespace) -> int:
    import httpx

    from .transport import auth_headers

    resp = httpx.delete(f"{args.http}/v1/decode/{args.id}", headers=auth_headers(args.api_key), timeout=60)
    print(json.dumps(resp.json(), indent=2))
    return 0 if resp.status_code == 200 else 1


def cmd_identity(args: argparse.Namespace) -> int:
    from .model.identity import file_sha256, read_identity
    from .model.registry import resolve_model_arg

    path, named_alias = resolve_model_arg(args.model)  # a GGUF path or a named model
    ident = read_identity(str(path), alias=args.alias or named_alias).with_hash(file_sha256(path))
    print(json.dumps(ident.info_fields(), indent=2))
    return 0


def cmd_settings(_args: argparse.Namespace) -> int:
    print(settings_table(CHOICES))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="hydra-trio", description="hydra-trio decode engine")
    parser.add_argument("--version", action="version", version=f"hydra-trio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the engine (HTTP + binary RPC)")
    add_arguments(p, CHOICES)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser(
        "make-model",
        help="write a synthetic GGUF (random weights; mamba: a recurrent model; hybrid: lfm2; embed: mean pooling; "
        "rerank: a rank head; fim: fill-in-the-middle tokens; bert: an encoder; vision: tiny's text model and its "
        "projector OUT.mmproj.gguf; --lora BASE: a LoRA adapter for BASE)",
    )
    p.add_argument("out", help="output .gguf path")
    p.add_argument(
        "--preset",
        choices=["tiny", "small", "bench", "mamba", "hybrid", "embed", "rerank", "fim", "bert", "vision"],
        default="tiny",
    )
    p.add_argument("--pooling", choices=["none", "mean", "cls", "last", "rank"], default=None,
                   help="the model's own pooling type (an embedding model of another preset's size; rank needs "
                   "--preset rerank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="general.name")
    p.add_argument("--tag", action="append", help="general.tags entry (repeatable)")
    p.add_argument("--base-model", default=None, help="general.base_model.0.name")
    p.add_argument("--tokenizer-pre", default=None, help="tokenizer.ggml.pre")
    p.add_argument("--kv", action="append", type=_kv_pair, help="extra metadata KEY=VALUE, e.g. "
                   "llama.nextn_predict_layers=1")
    p.add_argument("--lora", metavar="BASE", default=None, help="write a LoRA adapter GGUF for the base model BASE "
                   "instead of a model")
    p.add_argument("--lora-rank", type=int, default=8, help="with --lora: the adapter's rank")
    p.add_argument("--lora-alpha", type=float, default=None, help="with --lora: adapter.lora.alpha (default: the rank)")
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("identity", help="print the model identity of a GGUF (spec "
                       "§5), model_hash (its SHA-256) included")
    p.add_argument("model", help="GGUF path or a named model (gemma3-270m)")
    p.add_argument("--alias", default=None)
    p.set_defaults(fn=cmd_identity)

    p = sub.add_parser("settings", help="print every serve setting with its env variable")
    p.set_defaults(fn=cmd_settings)

    rpc = {"type": _rpc_address, "default": ("127.0.0.1", 9504), "help": "engine RPC HOST:PORT"}
    p = sub.add_parser("info", help="INFO of a running engine")
    p.add_argument("--rpc", **rpc)
    p.set_defaults(fn=cmd_info)

    for name, fn, what in (
        ("prefill", cmd_prefill, "PREFILL a message; write the KV blob"),
        ("decode", cmd_decode, "DECODE a message (with a KV blob)"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("message")
        p.add_argument("--rpc", **rpc)
        p.add_argument("--slot", type=int, default=0)
        p.add_argument("--max-tokens", type=int, default=64)
        if name == "prefill":
            p.add_argument("--out", default="kv.blob", help="where to write the blob")
        else:
            p.add_argument("--kv", default=None, help="KV blob file (from prefill); none: continue the slot")
            p.add_argument("--kv-meta", default=None, help="JSON file with the PREFILL meta (identity for the gate)")
        p.set_defaults(fn=fn)

    for name, fn, what in (
        ("result", cmd_result, "read a decode result"),
        ("cancel", cmd_cancel, "DELETE a decode request"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("id", type=int)
        p.add_argument("--http", default="http://127.0.0.1:8080")
        p.add_argument("--api-key", default=None, help="the engine's API key (default: env HYDRA_API_KEY)")
        if name == "result":
            p.add_argument("--stream", action="store_true", help="stream over SSE")
            p.add_argument("--wait", type=float, default=60.0)
        p.set_defaults(fn=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.fn is not cmd_serve:
        # Client commands: an engine that is not there is one clear line, not a traceback.
        import httpx

        try:
            return int(args.fn(args) or 0)
        except (OSError, httpx.TransportError) as exc:
            target = getattr(args, "rpc", None) or getattr(args, "http", "")
            where = f"{target[0]}:{target[1]}" if isinstance(target, tuple) else target
            print(f"hydra-trio {args.command}: cannot reach the engine at {where}: {exc}", file=sys.stderr)
            return 1
    # A native fault (a llama.cpp kernel) kills the process without a Python exception: this
    # writes which call it was to stderr, after the engine's last log line.
    faulthandler.enable()
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
