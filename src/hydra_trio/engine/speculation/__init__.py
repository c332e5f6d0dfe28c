"""Speculative decoding (n-gram prompt lookup): the drafter of each request, the one draft
policy and accept rule (``DraftPlanner``, which the backend's steps call), and the cost of a
forward pass by rows that the policy prices drafts with. Nothing outside this package reaches
its modules."""

from .drafter import NgramMemories, NgramMemory, SpecConfig, SpecCounts, Speculation
from .policy import DraftPlanner
from .request import SpecRequest, request_speculation, spec_config

__all__ = [
    "DraftPlanner",
    "NgramMemories",
    "NgramMemory",
    "SpecConfig",
    "SpecCounts",
    "SpecRequest",
    "Speculation",
    "request_speculation",
    "spec_config",
]
