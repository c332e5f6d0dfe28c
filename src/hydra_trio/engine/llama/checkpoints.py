"""Context checkpoints (llama-server's ``--ctx-checkpoints``): roll-back points for a memory
that cannot simply be cut back.

A window-sized SWA cache drops a sequence's SWA cells older than the window as it advances,
so a slot cut back by more than a position or two cannot be continued: the cells its window
needs before the cut are gone. A recurrent state (Mamba, RWKV, the recurrent half of a hybrid
model) is one per sequence, at its last position: no cut at all keeps it. An agent's next turn
cuts exactly there (the reply rendered differently, a second session behind the same system
prompt). So, as llama-server does for both, a prefill stops a few tokens before the prompt's
end (4, and a batch), copies the slot's partial state (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``:
the SWA window or the recurrent state, not the whole KV), and goes on; a restored KV blob's
checkpoint section is kept here too. A later prompt that shares at least a checkpoint's
positions restores that partial state and keeps the other layers' cells up to it, evaluating
only the rest.

Pure bookkeeping: the llama calls are the backend's (kv_state.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Checkpoint:
    n_tokens: int  # positions the slot held when it was taken
    swa_low: int  # lowest position its SWA cells hold
    data: bytes  # llama_state_seq_get_data_ext(..., LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)


class Checkpoints:
    """Each slot's checkpoints, oldest first, at most ``per_slot`` of them (0: off)."""

    def __init__(self, n_slots: int, per_slot: int, n_batch: int) -> None:
        self.per_slot = per_slot
        # Where a prefill stops, counted back from the prompt's end (llama-server's offsets):
        # 4 leaves a few tokens to evaluate (a turn that re-renders the generation prompt), a
        # batch covers a reply rendered differently from what was generated.
        self._offsets = (n_batch, 4)
        self._by_slot: list[list[Checkpoint]] = [[] for _ in range(n_slots)]

    def cuts(self, n_prompt: int, n_keep: int) -> list[int]:
        """Positions where a prefill of ``n_prompt`` tokens, keeping ``n_keep``, stops for a
        checkpoint (ascending; none when checkpoints are off)."""
        if not self.per_slot:
            return []
        return sorted({n_prompt - off for off in self._offsets if n_prompt - off > n_keep})

    def add(self, slot: int, checkpoint: Checkpoint) -> None:
        if not self.per_slot:
            return
        held = [c for c in self._by_slot[slot] if c.n_tokens < checkpoint.n_tokens]
        held.append(checkpoint)
        self._by_slot[slot] = held[-self.per_slot :]

    def best(self, slot: int, n_keep: int) -> Checkpoint | None:
        """The latest checkpoint a slot cut back to ``n_keep`` positions can resume from."""
        return max((c for c in self._by_slot[slot] if c.n_tokens <= n_keep), key=lambda c: c.n_tokens, default=None)

    def forget(self, slot: int, above: int = 0) -> None:
        """Drop the slot's checkpoints past ``above`` positions (its history changed there)."""
        self._by_slot[slot] = [c for c in self._by_slot[slot] if c.n_tokens <= above] if above else []

    def count(self, slot: int) -> int:
        return len(self._by_slot[slot])

    @property
    def nbytes(self) -> int:
        return sum(len(c.data) for cps in self._by_slot for c in cps)


def window_holds(n_swa: int, n_held: int, swa_low: int, n_keep: int) -> bool:
    """Whether a sequence of ``n_held`` positions whose SWA cells start at ``swa_low`` can be
    cut back to ``n_keep`` and continued: its window before the cut is all there."""
    if not n_swa or n_keep >= n_held - 1:
        return True  # keeping all, or all but the last position, keeps a full window
    return swa_low <= max(0, n_keep - n_swa)


def reusable_in_state(n_swa: int, n_tokens: int, n_keep: int) -> int:
    """The backend's ``reusable_prefix`` for a saved state of ``n_tokens`` positions (it
    holds the SWA cells of its last window only, and no checkpoints)."""
    return n_keep if window_holds(n_swa, n_tokens, max(0, n_tokens - n_swa), n_keep) else 0
