"""What the process tells the outside about itself: Prometheus metrics (``metrics.py``, with
vLLM's names in ``vllm_metrics.py``), the log lines (``logs.py``), the KV events a
cache-aware router subscribes to (``kv_publisher.py``, over ZMQ), and what every task waits
on when something hangs (``task_dump.py``, on SIGUSR1)."""

from .kv_publisher import (
    KvEventPublisher,
    event_encoding,
    expand_topic,
    open_kv_events,
    pod_name,
    topic_template,
)
from .logs import (
    BASE_FIELDS,
    REQUEST_FIELDS,
    STATS_FIELDS,
    configure_logging,
    generation_fields,
    log_stats,
    receipt_note,
    request_extra,
    spec_note,
)
from .metrics import Metrics, trio_task_count
from .task_dump import dump_lines

__all__ = [
    "BASE_FIELDS",
    "REQUEST_FIELDS",
    "STATS_FIELDS",
    "KvEventPublisher",
    "Metrics",
    "configure_logging",
    "dump_lines",
    "event_encoding",
    "expand_topic",
    "generation_fields",
    "log_stats",
    "open_kv_events",
    "pod_name",
    "receipt_note",
    "request_extra",
    "spec_note",
    "topic_template",
    "trio_task_count",
]
