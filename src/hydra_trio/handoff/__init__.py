"""The P/D hand-off of KV between engines: exports under a lease (exports.py) in host
memory or shared-memory files (shm.py), the prefill side (prefill.py), the decode side's
pull client (pull.py) and restore-or-fallback (restore.py). The codec is wire/kvpull.py;
the HTTP hooks every completion route calls are http/completions/kv_transfer.py."""
