"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own (one per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Requests, tokens, queue depth, KV bytes held, admissions and rejections, time to first token, decode rate."""

    def __init__(self, kv_cap_bytes: int) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "kvsieve_requests", "Generation requests received, by endpoint", ["endpoint"], registry=registry
        )
        self.admitted = Counter("kvsieve_requests_admitted", "Requests admitted to run", registry=registry)
        self.rejected = Counter(
            "kvsieve_requests_rejected",
            "Requests refused: invalid (4xx), unauthorized (401), too_large (413) or queue_full (429)",
            ["reason"],
            registry=registry,
        )
        self.finished = Counter(
            "kvsieve_requests_finished",
            "Requests that ended, by finish reason (stop, length, cancelled, error)",
            ["reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter("kvsieve_prompt_tokens", "Prompt tokens prefilled", registry=registry)
        self.generation_tokens = Counter("kvsieve_generation_tokens", "Tokens generated", registry=registry)
        self.queue_depth = Gauge("kvsieve_queue_depth", "Requests waiting for admission", registry=registry)
        self.running = Gauge("kvsieve_running_requests", "Requests decoding", registry=registry)
        self.kv_held = Gauge(
            "kvsieve_kv_bytes_held", "KV cache bytes held now (keys, values, positions, state)", registry=registry
        )
        self.kv_held_max = Gauge(
            "kvsieve_kv_bytes_held_max", "Most KV cache bytes held after any step since start", registry=registry
        )
        self.kv_reserved = Gauge(
            "kvsieve_kv_bytes_reserved", "KV cache bytes reserved by the running requests", registry=registry
        )
        self.kv_cap = Gauge("kvsieve_kv_bytes_cap", "The KV memory cap (--kv-memory-gb)", registry=registry)
        self.kv_cap.set(kv_cap_bytes)
        self.most_held = 0
        self.ttft = Histogram(
            "kvsieve_time_to_first_token_seconds",
            "From arrival to the first generated token (queueing and prefill)",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.batch_rows = Histogram(
            "kvsieve_decode_batch_rows",
            "Requests decoded by one forward pass",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.kernels_compiled = Counter(
            "kvsieve_kernels_compiled",
            "Kernels compiled at first use, warm-up included (a step that compiled sets no decode rate)",
            registry=registry,
        )
        self.decode_rate = Gauge(
            "kvsieve_decode_tokens_per_second",
            "Tokens generated per second over the last step that compiled nothing",
            registry=registry,
        )

    def held(self, nbytes: int) -> None:
        """Record the bytes held after a step."""
        self.kv_held.set(nbytes)
        self.most_held = max(self.most_held, nbytes)
        self.kv_held_max.set(self.most_held)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
