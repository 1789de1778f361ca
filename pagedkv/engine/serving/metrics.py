"""Prometheus export of the engine's counters under names that mirror vLLM's (`vllm:prefix_cache_queries`
becomes `pagedkv:prefix_cache_queries`, ...). Optional: needs `prometheus_client` (pip install
"pagedkv[metrics]"). Values are read from LLM.stats() when Prometheus scrapes, in the HTTP server's
thread: nothing is added to the engine's step."""
from collections.abc import Callable

# (name, kind, help, the LLM.stats() key it reads). Counters are exported with the _total suffix.
METRICS = [
    ("prefix_cache_queries", "counter", "Prefix cache queries, in tokens (prompt tokens looked up)", "queries"),
    ("prefix_cache_hits", "counter", "Prefix cache hits, in tokens", "hits"),
    ("prefix_cache_query_blocks", "counter", "Prefix cache queries, in full blocks", "query_blocks"),
    ("prefix_cache_hit_blocks", "counter", "Prefix cache hits, in full blocks", "hit_blocks"),
    ("prefix_cache_evictions", "counter", "Cached blocks evicted to be reused", "evictions"),
    ("kv_cache_usage_perc", "gauge", "KV-cache usage: the fraction of the GPU blocks in use (1 = full)",
     "kv_cache_usage"),
    ("num_requests_running", "gauge", "Sequences running (holding device KV blocks)", "num_running"),
    ("num_requests_waiting", "gauge", "Sequences waiting (new or preempted by recompute)", "num_waiting"),
    ("num_requests_swapped", "gauge", "Sequences whose KV is swapped out to CPU blocks", "num_swapped"),
    ("num_preemptions", "counter", "Sequences preempted (by swap or recompute)", "num_preemptions"),
    ("prompt_tokens", "counter", "Prompt tokens computed (prefix-cache hits excluded)", "prefill_tokens"),
    ("generation_tokens", "counter", "Tokens generated", "generation_tokens"),
    ("spec_decode_num_draft_tokens", "counter", "Speculative draft tokens proposed", "spec_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "counter", "Speculative draft tokens accepted", "spec_accepted_tokens"),
]


def require_prometheus():
    try:
        import prometheus_client
    except ImportError:
        raise ImportError('metrics_port needs prometheus_client: pip install "pagedkv[metrics]" '
                          "(or pip install prometheus_client)") from None
    return prometheus_client


class PrometheusExporter:
    """Serves /metrics on addr:port (port 0: a free one, see .port) from a private registry."""

    def __init__(self, stats: Callable[[], dict], port: int, addr: str = "127.0.0.1", labels: dict | None = None):
        prometheus_client = require_prometheus()
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = dict(labels or {})
        families = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}

        class Collector:
            def collect(self):
                values = stats()
                for name, kind, doc, key in METRICS:
                    family = families[kind](f"pagedkv:{name}", doc, labels=list(labels))
                    family.add_metric(list(labels.values()), float(values[key]))
                    yield family

        self.registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self.registry.register(Collector())
        self._server, self._thread = prometheus_client.start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None
