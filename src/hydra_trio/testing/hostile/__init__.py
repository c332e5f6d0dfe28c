"""Hostile-client campaign: everything a bad or broken client can send, at once, beside
well-formed streams whose every token's arrival is timed.

    python -m benchmarks.hostile [--duration-s 60] [--short] [--seed 0] [--json PATH]

Starts a ``hydra-trio serve`` process (tiny synthetic model, loopback only; stops by itself)
and runs, together, until ``--duration-s``:

- an HTTP fuzzer over every route (seeded structure-aware mutations of valid bodies: wrong
  types, huge numbers, huge strings, deep nesting, bad UTF-8, lone surrogates, NaN, trailing
  garbage; and of the request around them: content types, bad/duplicate/huge headers,
  Content-Length that lies, broken chunked framing, odd paths and methods), on raw sockets so
  every byte is ours;
- the RPC fuzzer of hydra_trio.testing.rpcfuzz (run_campaign, reused as is);
- slow-drip senders (request line, headers and body a byte at a time) and stalled readers (a
  stream or a state snapshot started and never read);
- the shapes of issue 22: a 12 MB ``POST /detokenize``, 12 MB prompts to chat, completions,
  tokenize and render, a 4 M-token prompt array, bodies past --max-json-bytes (declared and
  chunked), 200 idle connections, KV pulls aimed at disallowed addresses (a listener on every
  interface, at the port they name, tells whether a connection was opened);
- well-formed streaming ``/v1/completions`` (``ignore_eos``), read in a separate process (so
  the driver's own CPU does not delay their reading), every token stamped with
  CLOCK_MONOTONIC, the clock the driver stamps each hostile request's start and end with.

Reported: requests per kind and status; findings (5xx other than the documented 503/507,
malformed replies, hangs past ``--hang-s``, a crash, outbound connections to disallowed
addresses, tracebacks in the engine's log, the engine's health afterwards); peak RSS against
the budget (model + KV cache + --max-inflight-bytes + --cache-ram-mib + --kv-export-max-bytes
+ RUNTIME_ALLOWANCE_MIB); /health latency; the streams' inter-token gaps (p50/p99/max), each
large gap attributed to the hostile requests in flight during it; then each shape alone
beside the streams (the solo phase: one request's own delay). Writes
benchmarks/results/hostile.json (``--short``: hostile-short.json).

The parts: config (Config, SHORT, the ledger), rawhttp, httpfuzz, campaign and shapes (the
actors), streams (the reader process), report, run (``campaign``, ``main``). Timing goals live here,
never in tests (tests/system/test_hostile_short.py asserts correctness only).
"""

from .campaign_config import HOSTILE_SCHEMAS, SHORT, Config
from .report import render
from .run import campaign, main

__all__ = ["HOSTILE_SCHEMAS", "SHORT", "Config", "campaign", "main", "render"]
