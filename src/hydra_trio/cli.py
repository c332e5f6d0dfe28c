"""Command line: `hydra-trio serve | make-model | identity`."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

import trio

from .config import Settings, add_arguments, settings_from, settings_table


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # llama.cpp's own log lines are DEBUG unless they are warnings or errors.
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)


async def _serve_until_signal(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM; then drain running decodes (a second signal stops now)."""
    from .app import Endpoints, serve
    from .decode.manager import DecodeManager

    log = logging.getLogger("hydra_trio")
    endpoints: Endpoints | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if endpoints is None or endpoints.state.decodes is None:
                        log.info("received %s during startup: stopping", name)
                        break
                    grace = settings.shutdown_grace_s
                    log.info("received %s: draining running decodes (up to %.0f s; signal again to stop now)", name, grace)
                    decodes = endpoints.state.decodes
                    async with trio.open_nursery() as drain:

                        async def run_drain(decodes: DecodeManager = decodes, grace: float = grace) -> None:
                            await decodes.drain(grace)
                            drain.cancel_scope.cancel()

                        drain.start_soon(run_drain)
                        async for _ in signals:  # a second signal: stop without waiting
                            drain.cancel_scope.cancel()
                    break
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signals)
            endpoints = await nursery.start(serve, settings)
    log.info("stopped")


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    _setup_logging(settings.log_level)
    trio.run(_serve_until_signal, settings)
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from .model.synthetic import write_model

    path = write_model(args.out, args.preset, seed=args.seed, name=args.name, tags=args.tag or ())
    print(path)
    return 0


def cmd_identity(args: argparse.Namespace) -> int:
    from .model.identity import read_identity

    ident = read_identity(args.model, alias=args.alias)
    print(json.dumps(ident.info_fields(), indent=2))
    return 0


def cmd_settings(_args: argparse.Namespace) -> int:
    print(settings_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hydra-trio", description="hydra-trio decode engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the engine (HTTP + binary RPC)")
    add_arguments(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("make-model", help="write a synthetic llama GGUF (random weights)")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--preset", choices=["tiny", "small", "bench"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="general.name")
    p.add_argument("--tag", action="append", help="general.tags entry (repeatable)")
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("identity", help="print the model identity of a GGUF (spec §5)")
    p.add_argument("model")
    p.add_argument("--alias", default=None)
    p.set_defaults(fn=cmd_identity)

    p = sub.add_parser("settings", help="print every serve setting with its env variable")
    p.set_defaults(fn=cmd_settings)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
