"""KV beyond one decode: a slot's KV copied out and restored (copy.py), the host prompt cache
(promptcache.py), the disk tier (disktier.py), both as one (tiers.py), the eviction order of every
tier (retention.py), which blocks the slots hold for KV events (blocks.py), and the one admission
of a received blob (admission.py: parse, bound, identity gate, layout). Nothing outside this
package reaches its modules."""

from .admission import Admitted, admit_blob
from .blocks import HostBlocks, SlotBlocks
from .copy import KvCopy, check_checkpoint, copy_out, restore_blob
from .disktier import DiskStats, DiskTier, kv_fingerprint
from .promptcache import CacheHit, PromptCache, PromptCacheStats
from .retention import EVICTION_KINDS, POLICIES, KvOwner, Retention
from .tiers import HostTiers

__all__ = [
    "EVICTION_KINDS",
    "POLICIES",
    "Admitted",
    "CacheHit",
    "DiskStats",
    "DiskTier",
    "HostBlocks",
    "HostTiers",
    "KvCopy",
    "KvOwner",
    "PromptCache",
    "PromptCacheStats",
    "Retention",
    "SlotBlocks",
    "admit_blob",
    "check_checkpoint",
    "copy_out",
    "kv_fingerprint",
    "restore_blob",
]
