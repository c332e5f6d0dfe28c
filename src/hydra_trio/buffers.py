"""Buffers that received payloads (RPC payloads, state uploads, pulled KV) are read into."""

from __future__ import annotations

import mmap

import numpy as np

_NO_HUGEPAGES_MIN = 4 << 20  # numpy madvises huge pages for arrays from this size on
_MMAP_MIN = 64 << 20  # above glibc malloc's largest mmap threshold: smaller buffers reuse heap pages


def payload_buffer(n: int) -> np.ndarray:
    """One buffer of ``n`` bytes for a payload to be received into.

    Below 4 MiB, uninitialised heap memory (``np.empty``): no zero-fill pass, and the
    receive writes every byte before anything reads it (a short read drops the buffer).
    From 4 MiB, ``np.empty`` would ask for transparent huge pages (numpy's madvise), and with
    the kernel's "madvise" defrag a page fault then stalls for compaction (DECODE acks of a
    151 MB blob varied 80-380 ms). So from there: a bytearray up to 64 MiB (zeroed, but malloc
    reuses already-mapped heap pages, which measured 2-3x faster than faulting in a fresh
    mapping at 1-17 MB), and an anonymous mapping above (the kernel supplies zero pages as
    the receive first writes them: no zeroing pass, no huge pages)."""
    if n < _NO_HUGEPAGES_MIN:
        return np.empty(n, dtype=np.uint8)
    if n < _MMAP_MIN:
        return np.frombuffer(bytearray(n), dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)
