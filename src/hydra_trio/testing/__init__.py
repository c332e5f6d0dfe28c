"""What the tests and the benchmarks share: loopback ports, the SSE and /metrics readers,
the RPC fuzzer and the hostile-client campaign. Importable as ``hydra_trio.testing`` from
both (no ``sys.path`` edits); nothing in the engine imports it."""
