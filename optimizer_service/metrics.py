"""Prometheus metrics of one replica, on an injected registry (tests pass a fresh one).

Labels are table, node, endpoint, status, reason and worker (an index below
`max(workers, WORKER_SERIES)`): never an id or a key. Per-node memcached gauges and the
rows not written yet are refreshed at scrape time. The cluster's namespace is on one info
series (`lookup_table_info`), and no counter has a `_created` series.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["WORKER_SERIES", "ServiceMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
WORKER_SERIES = 64
"""Workers with an index below `max(workers, WORKER_SERIES)` get series of their own;
the pushes of higher indices (a client's bug, or more async trainers than that) share
`worker="other"`, so a client cannot make the series unbounded."""


class ServiceMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        namespace: str = "",
        replica: int = 0,
        replicas: int = 1,
        mode: str = "async",
        workers: int = 1,
    ) -> None:
        self.registry = registry
        # the metrics live in a registry of their own, published through `_NoCreated`:
        # prometheus_client's switch for `_created` series is process-wide
        # (disable_created_metrics, $PROMETHEUS_DISABLE_CREATED_SERIES)
        own = CollectorRegistry(auto_describe=True)
        self.info = Info(
            "lookup_table",
            "The replica's cluster: join it on instance to label any series by namespace",
            registry=own,
        )
        self.info.info(
            {
                "namespace": namespace,
                "replica": str(replica),
                "replicas": str(replicas),
                "mode": mode,
            }
        )
        self.workers = _WorkerStats(max(workers, WORKER_SERIES), own)
        self.unwritten_rows = Gauge(
            "lookup_table_unwritten_rows",
            "Rows (with their slots) this replica holds that memcached does not yet: written "
            "behind, until the next flush",
            registry=own,
        )
        self.unflushed_pushes = Gauge(
            "lookup_table_unflushed_pushes",
            "Pushes applied since the last flush of the rows written behind (their journals "
            "are kept until it)",
            registry=own,
        )
        self.pushes = Counter(
            "lookup_table_pushes", "Gradient pushes by outcome", ["status"], registry=own
        )
        self.rows_updated = _TableCounter(
            "lookup_table_rows_updated",
            "Rows updated by the optimizer",
            ("table",),
            own,
        )
        self.gradients_dropped = _TableCounter(
            "lookup_table_gradients_dropped",
            "Gradients of ids without a row dropped (tables with admit_after: not admitted yet)",
            ("table",),
            own,
        )
        self.rows_read = _TableCounter(
            "lookup_table_rows_read",
            "Rows trainers read through this replica (POST /v1/rows, a push's read), by table "
            "and whether they existed (new: no row yet, answered with its initial value)",
            ("table", "row"),
            own,
        )
        self.rejected = Counter(
            "lookup_table_rejected_pushes",
            "Pushes answered 4xx, by reason",
            ["reason"],
            registry=own,
        )
        self.duplicates = Counter(
            "lookup_table_duplicate_pushes",
            "Pushes whose push_id was already applied",
            registry=own,
        )
        self.push_latency = Histogram(
            "lookup_table_push_latency_seconds",
            "Time to apply one push",
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.requests = Counter(
            "lookup_table_http_requests",
            "HTTP requests",
            ["endpoint", "status"],
            registry=own,
        )
        self.version = Gauge("lookup_table_version", "Current model version", registry=own)
        self.rows_locked = Gauge(
            "lookup_table_rows_locked", "Rows held by in-flight pushes", registry=own
        )
        self.row_cache_bytes = Gauge(
            "lookup_table_row_cache_bytes",
            "Memory of the replica's row cache (bounded by service.cache_mb)",
            registry=own,
        )
        self.node_items = Gauge(
            "lookup_table_node_items", "memcached curr_items", ["node"], registry=own
        )
        self.node_bytes = Gauge(
            "lookup_table_node_bytes", "memcached bytes used", ["node"], registry=own
        )
        self.node_limit = Gauge(
            "lookup_table_node_limit_bytes",
            "memcached limit_maxbytes",
            ["node"],
            registry=own,
        )
        self.node_fill = Gauge(
            "lookup_table_node_fill_ratio", "bytes / limit_maxbytes", ["node"], registry=own
        )
        self.node_evictions = Gauge(
            "lookup_table_node_evictions",
            "memcached evictions (must stay 0 with -M)",
            ["node"],
            registry=own,
        )
        self.node_up = Gauge(
            "lookup_table_node_up",
            "1 if the node answered stats at the last scrape",
            ["node"],
            registry=own,
        )

        registry.register(_NoCreated(own))

    def count_rows_updated(self, table: str, n: int) -> None:
        self.rows_updated.add((table,), n)

    def count_gradients_dropped(self, table: str, n: int) -> None:
        self.gradients_dropped.add((table,), n)

    def count_rows_read(self, table: str, existing: int, new: int) -> None:
        self.rows_read.add((table, "existing"), existing)
        if new:
            self.rows_read.add((table, "new"), new)

    def count_push(self, worker: int, examples: int | None, loss: float | None) -> None:
        """A push of `worker` applied (not a duplicate), with the stats it carried."""
        self.workers.count(worker, examples, loss)


class _TableCounter:
    """A counter per table (and row kind) counted at every push and read: a plain dict
    added to, published at scrape time as a Prometheus counter family of the same name and
    labels. A `Counter` child's `inc` takes a lock and checks its amount, and a push and
    read of many tables would make dozens of them."""

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


class _WorkerStats:
    """Per worker: pushes applied, examples they carried, when the last one was applied
    (unix seconds) and the last loss reported; plain dicts published at scrape time, as
    `_TableCounter`."""

    def __init__(self, bound: int, registry: CollectorRegistry) -> None:
        self.bound = bound
        self.pushes: dict[str, float] = {}
        self.examples: dict[str, float] = {}
        self.last_push: dict[str, float] = {}
        self.loss: dict[str, float] = {}
        registry.register(self)

    def count(self, worker: int, examples: int | None, loss: float | None) -> None:
        label = str(worker) if worker < self.bound else "other"
        self.pushes[label] = self.pushes.get(label, 0) + 1
        self.last_push[label] = time.time()
        if examples is not None:
            self.examples[label] = self.examples.get(label, 0) + examples
        if loss is not None:
            self.loss[label] = loss

    def _families(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        return [
            CounterMetricFamily(
                "lookup_table_worker_pushes",
                "Pushes applied, by worker (duplicates and refused pushes not counted)",
                labels=["worker"],
            ),
            CounterMetricFamily(
                "lookup_table_worker_examples",
                "Training examples of the pushes applied, by worker, as the trainers report "
                "them (rate(): examples/s)",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "lookup_table_worker_last_push_timestamp_seconds",
                "When the worker's last push was applied (unix seconds): time() - this is "
                "how long it has not pushed",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "lookup_table_worker_loss",
                "The last training loss the worker reported with a push",
                labels=["worker"],
            ),
        ]

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        return self._families()

    def collect(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        families = self._families()
        for family, values in zip(
            families, (self.pushes, self.examples, self.last_push, self.loss), strict=True
        ):
            for label, value in sorted(values.items()):
                family.add_metric([label], value)
        return families


class _NoCreated:
    """The metrics of a registry without their `_created` series (when each counter
    and histogram was created: a series per counter that dashboards do not use)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterable[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric
