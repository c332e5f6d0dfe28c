"""``python -m benchmarks.reply_parsers [--chars 20000]``: what a hostile reply costs the
tool-call parsers (issue 50), in this thread's CPU time (other work on the machine does not
count): for each format, an opener, ``--chars`` of whitespace and a closer, read whole and
streamed a character a piece (as a model emits it), and the same with the opener repeated
(nesting 1,000 deep, in each family's own call shape, is tests/engine/chat/test_reply_bounds.py's). Runs on whatever
``hydra_trio`` the interpreter imports, so another checkout is measured side by side (PYTHONPATH)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from hydra_trio.engine.chat import ReplyParser, parse_reply
from hydra_trio.engine.chat.formats import FORMATS, ToolFormat


def cpu(fn: Any) -> float | str:
    t0 = time.thread_time()
    try:
        fn()
    except Exception as exc:  # what the parsers raised before issue 50
        return f"raised {type(exc).__name__}"
    return round(time.thread_time() - t0, 3)


def whole(fmt: ToolFormat, text: str) -> None:
    parse_reply(text, fmt, parse_tools=True, reasoning=False)


def streamed(fmt: ToolFormat, text: str) -> None:
    p = ReplyParser(fmt, parse_tools=True, reasoning=False)
    for c in text:
        p.feed(c)
    p.finish()


def marks(fmt: ToolFormat) -> tuple[str, str]:
    if fmt.block is not None:
        return fmt.block.openers[0], fmt.block.closer
    if fmt.opener:
        return fmt.opener, fmt.closer
    return ("<|channel|>", "<|message|>") if fmt.channels else ("{", "}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.reply_parsers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=20000)
    ap.add_argument("--formats", default="hermes,kimi_k2,deepseek,qwen3_coder,glm,minimax,cohere,gemma4,harmony")
    args = ap.parse_args(argv)
    rows: dict[str, dict[str, Any]] = {}
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        opener, closer = marks(fmt)
        spaced = opener + " " * args.chars + closer
        repeated = opener * (args.chars // len(opener)) + closer
        rows[name] = {
            "whitespace_whole_s": cpu(lambda f=fmt, t=spaced: whole(f, t)),
            "whitespace_streamed_s": cpu(lambda f=fmt, t=spaced: streamed(f, t)),
            "openers_whole_s": cpu(lambda f=fmt, t=repeated: whole(f, t)),
            "openers_streamed_s": cpu(lambda f=fmt, t=repeated: streamed(f, t)),
        }
        print(name, json.dumps(rows[name]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
