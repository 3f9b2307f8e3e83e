"""Prometheus metrics of a sluice process, served over HTTP by `sluice run --metrics-port`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds: from a few ms (a warm decode step) to minutes (a long request on a busy CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sluice_requests_total",
            "Requests by outcome (ok, error code, abort).",
            ["outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "From the request's publish to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "sluice_time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sluice_request_latency_seconds",
            "From the request's publish to its final event.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "sluice_queue_time_seconds",
            "From the request's publish to its first step.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_topic = Histogram(
            "sluice_time_in_topic_seconds",
            "From the request's publish until the pipeline read it (part of the queue time).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "sluice_generated_tokens_total", "Generated tokens (rate() gives tokens/s).", registry=r
        )
        self.prompt_tokens = Counter("sluice_prompt_tokens_total", "Prompt tokens.", registry=r)
        self.cached_tokens = Counter(
            "sluice_cached_prompt_tokens_total",
            "Prompt tokens served by the prefix cache.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "sluice_queue_depth",
            "Messages waiting in an actor's mailbox or the engine.",
            ["queue"],
            registry=r,
        )
        self.in_flight = Gauge(
            "sluice_requests_in_flight", "Requests read from Kafka and not finished.", registry=r
        )
        self.kv_cache_usage = Gauge(
            "sluice_kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use.",
            ["runner"],
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "sluice_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache / prompt tokens looked up.",
            ["runner"],
            registry=r,
        )
        self.preemptions = Gauge(
            "sluice_preemptions", "Sequences preempted (recomputed) so far.", ["runner"], registry=r
        )
        self.kv_pinned_blocks = Gauge(
            "sluice_kv_pinned_blocks",
            "KV blocks of finished turns kept for their next turn (keep_kv).",
            ["runner"],
            registry=r,
        )
        self.consumer_lag = Gauge(
            "sluice_consumer_lag",
            "Records behind the end of the partition.",
            ["topic", "partition"],
            registry=r,
        )
        self.redis_available = Gauge(
            "sluice_redis_available",
            "1 when the session store answers; 0 means no prefix reuse across turns.",
            registry=r,
        )
        self.redis_failures = Counter(
            "sluice_redis_failures_total", "Session-store calls that failed.", registry=r
        )
        self.paused = Gauge(
            "sluice_consumer_paused",
            "1 while input partitions are paused (backpressure).",
            registry=r,
        )
        self.pauses = Counter(
            "sluice_consumer_pauses_total",
            "Times the input partitions were paused because max_in_flight records were "
            "unfinished (backpressure).",
            registry=r,
        )
        self.runner_queue_bound = Gauge(
            "sluice_runner_queue_bound",
            "Most requests a runner may hold (its configured bound).",
            ["runner"],
            registry=r,
        )
        self.runner_peak_queue = Gauge(
            "sluice_runner_peak_queue",
            "Most requests the runner held at once so far.",
            ["runner"],
            registry=r,
        )
        self.runner_finished = Counter(
            "sluice_runner_finished_requests_total",
            "Requests the runner generated to their end.",
            ["runner"],
            registry=r,
        )
        self.runner_passed_on = Counter(
            "sluice_runner_passed_on_requests_total",
            "Requests a prefill runner passed on to a decode runner after their first token.",
            ["runner"],
            registry=r,
        )
        self.routed = Counter(
            "sluice_routed_requests_total",
            "Requests the scheduler sent to each runner, by why it chose that runner (prefix, "
            "session, least loaded, round robin, failover).",
            ["runner", "why"],
            registry=r,
        )
        self.routed_cached_blocks = Counter(
            "sluice_routed_cached_blocks_total",
            "Prompt blocks the routing index expected the chosen runner to hold cached.",
            ["runner"],
            registry=r,
        )
        self.failover_moved = Counter(
            "sluice_failover_moved_requests_total",
            "Unfinished requests moved from a dead runner's work topic to a live runner.",
            ["runner"],
            registry=r,
        )
        self.runners_live = Gauge(
            "sluice_runners_live",
            "Runners whose KV events the scheduler heard from recently (routed modes).",
            registry=r,
        )
