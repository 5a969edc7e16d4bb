"""Prometheus metric families built lazily from a table (``name -> (kind, labels, help)``): one place for it.

The fog broker and the coordinator both export their state at scrape time as
``prometheus_client`` families from a pure snapshot; each keeps its own table
and prefix. ``get`` alone exports a family with no samples (typed, empty), so
a dashboard sees every metric from the first scrape.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

__all__ = ["Families", "MetricTable"]

MetricTable = Mapping[str, tuple[str, Sequence[str], str]]  # short name -> (kind, label names, help)


class Families:
    """The families of ``table`` under ``prefix``, made on first use (gauge, counter, histogram, info)."""

    def __init__(self, prefix: str, table: MetricTable) -> None:
        self.prefix = prefix
        self.table = table
        self.fams: dict[str, Metric] = {}

    def name(self, short: str) -> str:
        return f"{self.prefix}_{short}"

    def get(self, short: str) -> Any:
        fam = self.fams.get(short)
        if fam is None:
            kind, labels, doc = self.table[short]
            name = self.name(short)
            if kind == "gauge":
                fam = GaugeMetricFamily(name, doc, labels=labels)
            elif kind == "counter":
                fam = CounterMetricFamily(name, doc, labels=labels)
            elif kind == "histogram":
                fam = HistogramMetricFamily(name, doc, labels=labels)
            else:  # an info family is named without its "_info" suffix
                fam = InfoMetricFamily(name[:-len("_info")], doc, labels=labels)
            self.fams[short] = fam
        return fam

    def add(self, short: str, value: float, *labels: str) -> None:
        self.get(short).add_metric([str(x) for x in labels], float(value))

    def in_table_order(self) -> list[Metric]:
        return [self.fams[k] for k in self.table if k in self.fams]
