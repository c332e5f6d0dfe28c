"""The one /metrics reader: a Prometheus text exposition as samples."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

MetricSamples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_samples(text: str) -> MetricSamples:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out: MetricSamples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """One sample of a /metrics text (``name`` as exposed, e.g. ``..._total``; with these
    labels exactly, none by default), or None when it is not there."""
    return metric_samples(text).get((name, tuple(sorted(labels.items()))))
