"""What the process is doing right now, for an operator whose requests hang: every trio task
(its name and the line it waits on, as a tree of nurseries) and every thread's Python stack
(the GPU worker's shows the llama.cpp call it is in). ``hydra-trio serve`` writes it to its log
on SIGUSR1 (cli.py); py-spy shows the threads too, but not trio's tasks, which are where a
request waits on a slot, a lock or a peer.

Read in the trio thread (the task tree is trio's own, read between checkpoints) and bounded:
tasks alike under one nursery (the same name, waiting on the same line, such as a thousand
idle HTTP connections) are one line with their count, and the dump stops at ``max_lines``."""

from __future__ import annotations

import sys
import threading
import traceback
from collections import Counter
from collections.abc import Iterator

import trio

__all__ = ["dump_lines"]


def _where(task: trio.lowlevel.Task) -> str:
    """Where ``task`` waits: its innermost line outside trio and what of trio's it awaits
    there (``slots.py:12 in claim -> wait`` with the path from the package on), '' when it runs now."""
    frames = [(f, n) for f, n in task.iter_await_frames()]
    if not frames:
        return ""
    ours = [i for i, (f, _) in enumerate(frames) if not _is_trio(f.f_code.co_filename)]
    if not ours:
        frame, lineno = frames[-1]
        return f"{_short(frame.f_code.co_filename)}:{lineno} in {frame.f_code.co_name}"
    i = ours[-1]
    frame, lineno = frames[i]
    into = f" -> {frames[i + 1][0].f_code.co_name}" if i + 1 < len(frames) else ""
    return f"{_short(frame.f_code.co_filename)}:{lineno} in {frame.f_code.co_name}{into}"


def _is_trio(path: str) -> bool:
    return "/trio/" in path or "/contextlib.py" in path


def _short(path: str) -> str:
    """A path from its package on (``hydra_trio/…``, ``trio/…``), not the install's prefix."""
    for marker in ("/site-packages/", "/src/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return path


def _task_lines(task: trio.lowlevel.Task, depth: int) -> Iterator[str]:
    where = _where(task)
    yield f"{'  ' * depth}{task.name}" + (f"  @ {where}" if where else "  (running)")
    for nursery in task.child_nurseries:
        children = list(nursery.child_tasks)
        # Leaves alike (no nursery of their own, the same name and line) are counted, not listed.
        leaves = Counter((t.name, _where(t)) for t in children if not t.child_nurseries)
        shown: set[tuple[str, str]] = set()
        for child in children:
            key = (child.name, _where(child))
            if child.child_nurseries or leaves[key] == 1:
                yield from _task_lines(child, depth + 1)
            elif key not in shown:
                shown.add(key)
                yield f"{'  ' * (depth + 1)}{key[0]}  @ {key[1] or '(running)'}  x{leaves[key]}"


def _thread_lines() -> Iterator[str]:
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        yield f"thread {names.get(ident, '?')} ({ident}):"
        for entry in traceback.extract_stack(frame)[-12:]:  # the innermost calls say where it is
            yield f"  {_short(entry.filename)}:{entry.lineno} in {entry.name}"


def dump_lines(max_lines: int = 600) -> list[str]:
    """The trio task tree, then every thread's stack, at most ``max_lines`` lines (the last
    says how many were left out). Call it from the trio thread."""
    root = trio.lowlevel.current_root_task()
    lines = ["trio tasks:"]
    if root is not None:
        lines.extend(_task_lines(root, 1))
    lines.extend(_thread_lines())
    if len(lines) > max_lines:
        left = len(lines) - (max_lines - 1)
        lines = [*lines[: max_lines - 1], f"... {left} more lines left out"]
    return lines
