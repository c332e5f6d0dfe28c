"""Prompt text tokenized in slices on the GPU worker. llama.cpp's tokenizer first cuts the text
at every special token it holds (``tokenizer_st_partition``), and that pass is quadratic in
the number of them: 128 KiB of tiny ChatML turns (9,000 special tokens) took 0.45 s, 4 MiB
(what a 128k-token slot's text limit allows) would take minutes, all of it one call on the
worker every stream's next token waits for. Cut before a special token, the text tokenizes
to the same tokens piece by piece: each raw fragment between special tokens is tokenized on
its own, and a piece that starts with a special token starts as the fragment after one does.
So a long text goes to the worker a slice at a time (``SLICE_CHARS``), each cut checked where
it is made: the tokens of a window around it must be those of its two sides, so no special
token of another spelling spans it (else the next candidate is tried)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llama import LlamaBackend
    from .worker import GpuWorker

SLICE_CHARS = 8 << 10  # text a worker call tokenizes: a few ms, quadratic or not
SEARCH_CHARS = 8 * SLICE_CHARS  # how far past a slice a cut is looked for before the rest goes whole
MAX_TRIES = 16  # candidate cuts checked for one slice
Tokenize = Callable[[str], list[int]]
_SPECIALS: weakref.WeakKeyDictionary[LlamaBackend, SpecialTexts] = weakref.WeakKeyDictionary()


class SpecialTexts:
    """A vocabulary's special tokens as text, by length, to find where one starts."""

    def __init__(self, special: Mapping[int, bytes]) -> None:
        texts = {t.decode("utf-8", "replace") for t in special.values()}
        texts = {t for t in texts if t and "\ufffd" not in t}
        self.by_len: dict[int, frozenset[str]] = {}
        for t in texts:
            self.by_len.setdefault(len(t), frozenset())
            self.by_len[len(t)] |= {t}
        self.firsts = frozenset(t[0] for t in texts)
        self.longest = max(self.by_len, default=0)

    def starts_at(self, text: str, i: int) -> bool:
        return any(text[i:i + n] in group for n, group in self.by_len.items())

    def candidates(self, text: str, lo: int, hi: int) -> list[int]:
        """Up to MAX_TRIES places in [lo, hi) where a special token's text starts."""
        found: list[int] = []
        i = lo
        while i < hi and len(found) < MAX_TRIES:
            nxt = [k for c in self.firsts if (k := text.find(c, i, hi)) >= 0]
            if not nxt:
                break
            i = min(nxt)
            if self.starts_at(text, i):
                found.append(i)
            i += 1
        return found


def next_cut(text: str, start: int, specials: SpecialTexts, tokenize: Tokenize) -> int:
    """Where the slice that starts at ``start`` ends: a checked cut before a special token at
    least SLICE_CHARS on, or the text's end (short text, or no cut found: the rest whole)."""
    if len(text) - start <= 2 * SLICE_CHARS or not specials.longest:
        return len(text)
    span = 4 * specials.longest
    for p in specials.candidates(text, start + SLICE_CHARS, min(len(text), start + SEARCH_CHARS)):
        a, b = max(start, p - span), min(len(text), p + span)
        if tokenize(text[a:b]) == tokenize(text[a:p]) + tokenize(text[p:b]):
            return p
    return len(text)


async def tokenize_sliced(worker: GpuWorker, backend: LlamaBackend, text: str, *, add_special: bool) -> list[int]:
    """``backend.tokenize(text, add_special=..., parse_special=True)``, one slice a worker call
    (the other steps run between them). A vocabulary that adds a token at the end too (EOS or
    SEP with ``add_special``) is tokenized whole: its slices could not say which one ends."""
    roles = backend.info.roles
    if len(text) <= 2 * SLICE_CHARS or (add_special and (roles.add_eos or roles.add_sep)):
        return await worker.call(lambda: backend.tokenize(text, add_special=add_special))
    specials = _SPECIALS.get(backend)
    if specials is None:  # once per model (a reload's has its own)
        specials = _SPECIALS[backend] = SpecialTexts(backend.vocabulary.special)

    def plain(t: str) -> list[int]:
        return backend.tokenize(t, add_special=False)

    def piece(start: int) -> tuple[list[int], int]:
        end = next_cut(text, start, specials, plain)
        return backend.tokenize(text[start:end], add_special=add_special and start == 0), end

    tokens: list[int] = []
    start = 0
    while start < len(text):
        part, start = await worker.call(lambda s=start: piece(s))  # type: ignore[misc]
        tokens.extend(part)
    return tokens
