"""Start a long decode, DELETE it mid-generation, and show that it really stopped.

    python examples/cancel.py                      # an in-process engine
    python examples/cancel.py --e 127.0.0.1:8080:9504
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
except ImportError:
    from examples._common import add_engine_args, engines


async def cancel_demo(args: argparse.Namespace, out: Any = sys.stdout) -> dict[str, Any]:
    request = {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": args.max_tokens}
    async with engines([args.e], args.model) as (e,):
        async with await RpcClient.connect(e.host, e.rpc_port, trace="cancel-demo") as rpc:
            pre = await rpc.prefill(args.slot, request)
            frame = build_decode_frame(
                request, pre.payload, kv_metadata=identity_kv_metadata(pre.meta, pre.meta["n_past"])
            )
            ack = await rpc.decode(args.slot, frame)
            rid = ack.meta["decode_request_id"]
            print(f"decode {rid} started on slot {args.slot}, asking for {args.max_tokens} tokens", file=out)

            async with DecodeHttpClient(e.http_url) as http:
                seen = 0
                async for chunk in http.stream(rid):
                    if chunk["choices"][0]["delta"].get("content"):
                        seen += 1
                    if seen >= args.after:
                        break
                t0 = time.perf_counter()
                resp = await http.delete(rid)
                cancel_ms = (time.perf_counter() - t0) * 1000.0
                print(f"DELETE after {seen} streamed chunks -> "
                      f"{resp.status_code} {resp.json()} in {cancel_ms:.1f} ms", file=out)
                after = await http.result(rid, wait_s=0)
                print(f"GET afterwards -> {after.status_code} {after.json()}", file=out)
            meta = (await rpc.state_meta(args.slot)).meta
            print(f"slot {args.slot}: is_processing={meta['is_processing']}, n_past={meta['n_past']}", file=out)
            return {"delete": resp.json(), "delete_status": resp.status_code, "get_status": after.status_code,
                    "cancel_ms": cancel_ms, "slot_busy": meta["is_processing"], "streamed": seen}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, ["e"])
    parser.add_argument("--slot", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--after", type=int, default=10, help="DELETE after this many streamed chunks")
    args = parser.parse_args(argv)
    trio.run(cancel_demo, args)


if __name__ == "__main__":
    main()
