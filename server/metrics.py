"""The server's Prometheus metrics, in a registry of its own (one per app, so tests can run several)."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """Requests running and waiting, KV pages held, tokens in and out, how requests ended, TTFT and TPOT."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("fuselm_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge("fuselm_requests_waiting", "Requests queued for the engine", registry=r)
        self.kv_pages = Gauge("fuselm_kv_pages_used", "KV cache pages held by running requests "
                              "(continuous batching only)", registry=r)
        self.preemptions = Counter("fuselm_preemptions", "Requests sent back to wait because the KV "
                                   "pool was full (prefilled again later)", registry=r)
        self.prompt_tokens = Counter("fuselm_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("fuselm_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("fuselm_requests_finished", "Requests ended, by finish reason "
                                "(stop, length, cancelled, error)", ["finish_reason"], registry=r)
        self.ttft = Histogram("fuselm_time_to_first_token_seconds", "From submission (queue wait "
                              "included) to the first token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("fuselm_time_per_output_token_seconds", "Decode time per token after "
                              "the first, one observation per request", buckets=TPOT_BUCKETS, registry=r)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
