"""The roster of tool-call families: each family's module registers its ``ToolFormat`` here
when the package loads it (``families/__init__.py`` loads every module of the folder), and
everything that needs a family by name, or the order templates are told apart in, reads
this. Pure."""

from __future__ import annotations

from .toolformat import Detect, ToolFormat

_FORMATS: dict[str, ToolFormat] = {}
_PRIORITIES: dict[int, str] = {}  # a detection rule's priority -> the family it picks


def register(fmt: ToolFormat) -> ToolFormat:
    """Add ``fmt`` to the roster (a module's ``NAME = register(ToolFormat(...))``). A second
    family of one name, or a second rule at one priority, is refused: either would leave
    which one applies to the order modules happen to load in."""
    if fmt.name in _FORMATS:
        raise ValueError(f"tool-call family {fmt.name!r} is registered twice")
    taken = [d.priority for d in fmt.detect if d.priority in _PRIORITIES]
    if taken or len({d.priority for d in fmt.detect}) != len(fmt.detect):
        raise ValueError(f"tool-call family {fmt.name!r}: detection priority {taken or fmt.detect} is taken")
    _FORMATS[fmt.name] = fmt
    _PRIORITIES.update((d.priority, fmt.name) for d in fmt.detect)
    return fmt


def formats() -> dict[str, ToolFormat]:
    """Every registered family by name, in name order."""
    return {name: _FORMATS[name] for name in sorted(_FORMATS)}


def by_name(name: str) -> ToolFormat:
    """The family called ``name`` (--tool-call-parser); a ValueError naming the known ones."""
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"tool_call_parser: no tool-call family {name!r}; known: auto, {', '.join(sorted(_FORMATS))}")
    return fmt


def detection_order() -> tuple[tuple[Detect, ToolFormat], ...]:
    """Every detection rule with its family, lowest priority first: the order a template's
    source is held against them (``caps.detect_format``)."""
    rules = [(d, fmt) for fmt in _FORMATS.values() for d in fmt.detect]
    return tuple(sorted(rules, key=lambda rule: rule[0].priority))
