"""``/metrics``: the engine's counters in Prometheus' text format, read at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "smcsd"


class EngineCollector:
    """A Prometheus collector over ``stats()`` (an ``EngineStats``): nothing is counted twice."""

    def __init__(self, stats) -> None:
        self.stats = stats

    def collect(self):
        """The metric families of one scrape."""
        s = self.stats()
        requests = CounterMetricFamily(f"{PREFIX}_requests", "Engine requests by outcome", labels=["outcome"])
        for outcome, count in sorted(s.requests_total.items()):
            requests.add_metric([outcome], count)
        yield requests
        gauges = {
            "queue_depth": (s.queued, "Requests waiting to be admitted"),
            "queue_capacity": (s.max_queue, "Most requests that may wait"),
            "requests_running": (s.running, "Requests in the running batch"),
            "rows_in_use": (s.rows_in_use, "KV-cache rows held by running requests"),
            "rows_capacity": (s.max_rows, "Most rows in use at once"),
            "kv_cache_bytes": (s.kv_cache_bytes, "Bytes both KV caches hold now"),
            "kv_cache_budget_bytes": (s.kv_budget_bytes, "Most bytes both KV caches may hold"),
            "kv_bytes_per_row_position": (s.kv_bytes_per_row_position, "KV bytes of one row per position"),
            "last_cycle_seconds": (s.last_cycle_seconds, "Duration of the last cycle"),
            "mean_ess": (s.last_mean_ess, "Mean ESS/N of the running SMC requests in the last cycle"),
            "tokens_per_second": (
                s.tokens_total / s.cycle_seconds_total if s.cycle_seconds_total else 0.0,
                "Tokens per second of cycle time (busy throughput; rate(smcsd_tokens_total) for wall time)",
            ),
        }
        for name, (value, doc) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        counters = {
            "tokens": (s.tokens_total, "Tokens generated"),
            "cycles": (s.cycles_total, "Engine cycles run"),
            "cycle_seconds": (s.cycle_seconds_total, "Time spent in cycles"),
        }
        for name, (value, doc) in counters.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def metrics_text(stats) -> tuple[bytes, str]:
    """One scrape of ``stats`` and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats))
    return generate_latest(registry), CONTENT_TYPE_LATEST
