"""Prefill on engine A, hand the KV to engine B with one DECODE, stream B's result.

    python examples/pd_handoff.py                       # two in-process engines
    python examples/pd_handoff.py --a 127.0.0.1:8080:9504 --b 127.0.0.1:8081:9505

Prints the streamed text and the hand-off timings from hydra_metrics.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import trio

from hydra_trio.rpc.client import RpcClient, build_decode_frame, identity_kv_metadata
from hydra_trio.transport import DecodeHttpClient

try:
    from _common import add_engine_args, engines
except ImportError:  # imported as examples.pd_handoff
    from examples._common import add_engine_args, engines

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about the engine that decodes this."},
]


async def handoff(args: argparse.Namespace, out: Any = sys.stdout) -> dict[str, Any]:
    request = {"messages": MESSAGES, "max_tokens": args.max_tokens, "temperature": 0}
    async with engines([args.a, args.b], args.model) as (a, b):
        async with await RpcClient.connect(a.host, a.rpc_port, trace="pd-handoff") as rpc_a:
            t0 = time.perf_counter()
            pre = await rpc_a.prefill(args.slot, request)
            prefill_wall_ms = (time.perf_counter() - t0) * 1000.0
        print(f"A: PREFILL {pre.meta['n_past']} tokens in {pre.meta['prefill_ms']:.1f} ms, "
              f"blob {len(pre.payload)} bytes ({pre.meta['kv_hash']})", file=out)

        frame = build_decode_frame(
            request,
            pre.payload,
            model=pre.meta["model_alias"],
            kv_metadata=identity_kv_metadata(pre.meta, pre.meta["n_past"]),
        )
        async with await RpcClient.connect(b.host, b.rpc_port, trace="pd-handoff") as rpc_b:
            t0 = time.perf_counter()
            ack = await rpc_b.decode(args.slot, frame)
            ack_ms = (time.perf_counter() - t0) * 1000.0
        rid = ack.meta["decode_request_id"]
        print(f"B: DECODE acked in {ack_ms:.1f} ms: id {rid}, n_past {ack.meta['n_past_after_restore']}, "
              f"restore {ack.meta['restore_slot_ms']:.2f} ms", file=out)

        text: list[str] = []
        final: dict[str, Any] = {}
        async with DecodeHttpClient(b.http_url) as http:
            print("B: ", end="", file=out)
            async for chunk in http.stream(rid):
                choice = chunk["choices"][0]
                piece = choice["delta"].get("content") or ""
                text.append(piece)
                print(piece, end="", flush=True, file=out)
                if choice.get("finish_reason"):
                    final = chunk
        print(file=out)
        m = final["hydra_metrics"]
        print(
            "hand-off: prefill on A {:.1f} ms (wall {:.1f}), DECODE ack {:.1f} ms "
            "(validate {:.2f}, restore {:.2f}, queue {:.2f}), first token {:.1f} ms after ack, "
            "{} tokens at {:.1f} tok/s, n_common {}, logits_reused {}, stop {}".format(
                pre.meta["prefill_ms"], prefill_wall_ms, ack_ms, m["validate_ms"], m["restore_slot_ms"],
                m["queue_wait_ms"], m["ttft_ms"], final["usage"]["completion_tokens"], m["tokens_per_s"],
                m["n_common"], m["logits_reused"], m["stop_type"],
            ),
            file=out,
        )
        return {"text": "".join(text), "ack_ms": ack_ms, "hydra_metrics": m, "usage": final["usage"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, ["a", "b"])
    parser.add_argument("--slot", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    trio.run(handoff, args)


if __name__ == "__main__":
    main()
