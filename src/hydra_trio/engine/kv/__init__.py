"""KV beyond one decode: a slot's KV copied out and restored (copy.py), the host prompt cache
(promptcache.py), the eviction order of every tier (retention.py), which blocks the slots hold for KV events (blocks.py), and the one admission
of a received blob (admission.py: parse, bound, identity gate, layout). Nothing outside this
package reaches its modules."""

from .admission import Admitted, admit_blob
from .blocks import HostBlocks, SlotBlocks
from .copy import KvCopy, check_checkpoint, copy_out, restore_blob
from .promptcache import CacheHit, PromptCache, PromptCacheStats
from .retention import EVICTION_KINDS, POLICIES, KvOwner, Retention

__all__ = [
    "EVICTION_KINDS",
    "POLICIES",
    "Admitted",
    "CacheHit",
    "HostBlocks",
    "KvCopy",
    "KvOwner",
    "PromptCache",
    "PromptCacheStats",
    "Retention",
    "SlotBlocks",
    "admit_blob",
    "check_checkpoint",
    "copy_out",
    "restore_blob",
]
