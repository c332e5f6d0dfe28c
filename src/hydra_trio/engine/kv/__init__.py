"""KV beyond one decode: a slot's KV copied out and restored (copy.py), the host prompt cache
(promptcache.py), which blocks the slots hold for KV events (blocks.py), and the one admission
of a received blob (admission.py: parse, bound, identity gate, layout). Nothing outside this
package reaches its modules."""

from .admission import Admitted, admit_blob
from .blocks import HostBlocks, SlotBlocks
from .copy import KvCopy, check_checkpoint, copy_out, restore_blob
from .promptcache import CacheHit, PromptCache, PromptCacheStats

__all__ = [
    "Admitted",
    "CacheHit",
    "HostBlocks",
    "KvCopy",
    "PromptCache",
    "PromptCacheStats",
    "SlotBlocks",
    "admit_blob",
    "check_checkpoint",
    "copy_out",
    "restore_blob",
]
