"""Prometheus metrics of one replica, on an injected registry (tests pass a fresh one).

Labels are table, node, endpoint, status and reason: never an id or a key.
Per-node memcached gauges are refreshed from `stats` at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

__all__ = ["ServiceMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.pushes = Counter(
            "lookup_table_pushes", "Gradient pushes by outcome", ["status"], registry=registry
        )
        self.rows_updated = _TableCounter(
            "lookup_table_rows_updated",
            "Rows updated by the optimizer",
            ("table",),
            registry,
        )
        self.gradients_dropped = _TableCounter(
            "lookup_table_gradients_dropped",
            "Gradients of ids without a row dropped (tables with admit_after: not admitted yet)",
            ("table",),
            registry,
        )
        self.rows_read = _TableCounter(
            "lookup_table_rows_read",
            "Rows trainers read through this replica (POST /v1/rows), by table and whether "
            "they existed (new: no row yet, answered with its initial value)",
            ("table", "row"),
            registry,
        )
        self.rejected = Counter(
            "lookup_table_rejected_pushes",
            "Pushes answered 4xx, by reason",
            ["reason"],
            registry=registry,
        )
        self.duplicates = Counter(
            "lookup_table_duplicate_pushes",
            "Pushes whose push_id was already applied",
            registry=registry,
        )
        self.push_latency = Histogram(
            "lookup_table_push_latency_seconds",
            "Time to apply one push",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "lookup_table_http_requests",
            "HTTP requests",
            ["endpoint", "status"],
            registry=registry,
        )
        self.version = Gauge("lookup_table_version", "Current model version", registry=registry)
        self.rows_locked = Gauge(
            "lookup_table_rows_locked", "Rows held by in-flight pushes", registry=registry
        )
        self.row_cache_bytes = Gauge(
            "lookup_table_row_cache_bytes",
            "Memory of the replica's row cache (bounded by service.cache_mb)",
            registry=registry,
        )
        self.node_items = Gauge(
            "lookup_table_node_items", "memcached curr_items", ["node"], registry=registry
        )
        self.node_bytes = Gauge(
            "lookup_table_node_bytes", "memcached bytes used", ["node"], registry=registry
        )
        self.node_limit = Gauge(
            "lookup_table_node_limit_bytes",
            "memcached limit_maxbytes",
            ["node"],
            registry=registry,
        )
        self.node_fill = Gauge(
            "lookup_table_node_fill_ratio", "bytes / limit_maxbytes", ["node"], registry=registry
        )
        self.node_evictions = Gauge(
            "lookup_table_node_evictions",
            "memcached evictions (must stay 0 with -M)",
            ["node"],
            registry=registry,
        )
        self.node_up = Gauge(
            "lookup_table_node_up",
            "1 if the node answered stats at the last scrape",
            ["node"],
            registry=registry,
        )

    def count_rows_updated(self, table: str, n: int) -> None:
        self.rows_updated.add((table,), n)

    def count_gradients_dropped(self, table: str, n: int) -> None:
        self.gradients_dropped.add((table,), n)

    def count_rows_read(self, table: str, existing: int, new: int) -> None:
        self.rows_read.add((table, "existing"), existing)
        if new:
            self.rows_read.add((table, "new"), new)


class _TableCounter:
    """A counter per table (and row kind) counted at every push and read: a plain dict
    added to, published at scrape time as a Prometheus counter family of the same name and
    labels. A `Counter` child's `inc` takes a lock and checks its amount (~2 us), and a
    push and read of 26 tables made ~60 of them."""

    def __init__(
        self, name: str, documentation: str, labels: tuple[str, ...], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.counts: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def add(self, key: tuple[str, ...], amount: float) -> None:
        self.counts[key] = self.counts.get(key, 0) + amount

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=list(self.labels))

    def describe(self) -> list[CounterMetricFamily]:
        return [self._family()]

    def collect(self) -> list[CounterMetricFamily]:
        family = self._family()
        for key, value in self.counts.items():
            family.add_metric(list(key), value)
        return [family]
