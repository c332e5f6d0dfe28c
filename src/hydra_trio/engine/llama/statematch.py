"""Whether a KV state may go into this context: its K/V cache types, row sizes, layer counts
and V transposition against the local ones, as kv_transfer_params report them before any byte
moves (``cache_layout``, ``cache_layout_mismatch``) and as a received state's bytes lay them
out (``layout_mismatch``, on seqstate.py's reading), before a restore touches any slot.

Kept apart from seqstate.py because it changes with what admission checks and says, not with
llama.cpp's state layout. Pure: no llama_cpp import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...config import CACHE_TYPES
from .seqstate import StateLayout, StateRows

# ggml type ids of the K/V cache types llama-server offers, for messages.
_GGML_TYPES = {t: name for name, t in CACHE_TYPES.items()}


def type_name(t: int) -> str:
    """llama-server's cache-type name of a ggml type id (CACHE_TYPES), for messages."""
    return _GGML_TYPES.get(t, f"ggml type {t}")


def cache_layout(layout: StateLayout) -> dict[str, object]:
    """The KV cache layout a state was written in, as INFO, /version and kv_transfer_params
    report it: the K and V types and whether V rows are transposed (flash attention off).
    Empty for a recurrent model: it has no K/V cache (its recurrent rows are f32 always)."""
    rows = next((c.rows for c in layout.caches if c.rows is not None), None)
    if rows is None or not rows[1]:
        return {}
    v_trans, k_rows, v_rows = rows
    return {"type_k": type_name(k_rows[0][0]), "type_v": type_name(v_rows[0][0]), "v_trans": bool(v_trans)}


def cache_layout_mismatch(got: dict[str, object], local: dict[str, object]) -> str | None:
    """Why KV reported as ``got`` (kv_transfer_params, before any byte moves) cannot go into
    a context of ``local``, or None (also when either says nothing)."""
    for key, what in (("type_k", "K cache type"), ("type_v", "V cache type"), ("v_trans", "V transposition")):
        if key in got and key in local and got[key] != local[key]:
            return f"{what} {got[key]}, here {local[key]}"
    return None


def layout_mismatch(got: StateLayout, local: StateLayout) -> str | None:
    """Why a received state cannot go into this context (its K/V types, row sizes, layer
    counts or V transposition differ), or None. Compared per cache, where both hold cells."""
    if len(got.caches) != len(local.caches):
        return f"{len(got.caches)} KV caches, the resident model has {len(local.caches)}"
    for i, (a, b) in enumerate(zip(got.caches, local.caches, strict=True)):
        where = f"cache {i}: " if len(local.caches) > 1 else ""
        if a.recurrent or b.recurrent:
            why = _recurrent_mismatch(a.state_rows, b.state_rows)
            if why is not None:
                return f"{where}{why}"
            continue
        if a.rows is None or b.rows is None or a.rows == b.rows:
            continue
        (vt_a, k_a, v_a), (vt_b, k_b, v_b) = a.rows, b.rows
        if vt_a != vt_b:
            what = "transposed" if vt_a else "not transposed"
            return (
                f"{where}V rows {what} (flash attention {'off' if vt_a else 'on'} "
                "where the KV was made), here the opposite"
            )
        if len(k_a) != len(k_b):
            return f"{where}{len(k_a)} layers, the resident model has {len(k_b)}"
        if (
            said := _rows_mismatch(f"{where}layer", ("K/V cache types", "K/V row sizes"), (k_a, v_a), (k_b, v_b))
        ) is not None:
            return said
    return None


def _rows_mismatch(
    label: str,
    says: tuple[str, str],
    got: tuple[Sequence[Any], Sequence[Any]],
    local: tuple[Sequence[Any], Sequence[Any]],
) -> str | None:
    """The first layer whose pair of row shapes (K/V, or a recurrent state's R/S) differs: its
    types, else its sizes; None: all the same."""
    for layer, (xa, xb, ya, yb) in enumerate(zip(got[0], local[0], got[1], local[1], strict=True)):
        if xa[0] != xb[0] or ya[0] != yb[0]:
            return (
                f"{label} {layer}: {says[0]} {type_name(xa[0])}/{type_name(ya[0])}, here "
                f"{type_name(xb[0])}/{type_name(yb[0])}"
            )
        if xa != xb or ya != yb:
            return f"{label} {layer}: {says[1]} {xa[1:]}/{ya[1:]}, here {xb[1:]}/{yb[1:]}"
    return None


def _recurrent_mismatch(got: StateRows | None, local: StateRows | None) -> str | None:
    if got is None or local is None:
        return "a recurrent state where the resident model has a KV cache, or the reverse"
    if got == local:
        return None
    (n_a, r_a, s_a), (n_b, r_b, s_b) = got, local
    if n_a != n_b:
        return f"recurrent state of {n_a} layers, the resident model has {n_b}"
    return (
        _rows_mismatch("recurrent row", ("R/S types", "R/S row sizes"), (r_a, s_a), (r_b, s_b))
        or "recurrent state rows differ"
    )
