"""The draft server's Prometheus metrics: requests by status, latency, batch sizes, cached-token ratio, queue depth."""

import math
from collections.abc import Sequence

import prometheus_client

import draft_model

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """Prometheus metrics in a registry of their own, so two apps in one process never collide."""

    def __init__(self, max_batch_size: int):
        self.registry = registry = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "draft_server_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.latency = prometheus_client.Histogram(
            "draft_server_request_latency_seconds",
            "Time from request arrival to response, by endpoint",
            ["endpoint"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        batch_buckets = sorted({2**i for i in range(int(math.log2(max_batch_size)) + 1)} | {max_batch_size})
        self.batch_size = prometheus_client.Histogram(
            "draft_server_batch_size", "Requests per draft_batch call", registry=registry, buckets=batch_buckets
        )
        self.batch_seconds = prometheus_client.Histogram(
            "draft_server_batch_seconds",
            "Time spent inside draft_batch per batch",
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.failed_batches = prometheus_client.Counter(
            "draft_server_failed_batches", "draft_batch calls that raised", registry=registry
        )
        self.deadline_expired = prometheus_client.Counter(
            "draft_server_queue_deadline_expired",
            "Requests answered 503 because they waited in the queue longer than --queue-deadline-s",
            registry=registry,
        )
        self.prompt_tokens = prometheus_client.Counter(
            "draft_server_prompt_tokens",
            "Prompt tokens of the requests the model drafted (not lookup drafts)",
            registry=registry,
        )
        self.cached_tokens = prometheus_client.Counter(
            "draft_server_cached_tokens", "Prompt tokens whose KV came from the prefix cache", registry=registry
        )
        self.cached_ratio = prometheus_client.Gauge(
            "draft_server_cached_token_ratio", "cached_tokens / prompt_tokens since start", registry=registry
        )
        self.draft_tokens = prometheus_client.Counter(
            "draft_server_draft_tokens", "Draft tokens returned", registry=registry
        )
        self.lookup_drafts = prometheus_client.Counter(
            "draft_server_lookup_drafts",
            "Drafts copied from the request's own tokens (hybrid drafting)",
            registry=registry,
        )
        self.queue_depth = prometheus_client.Gauge(
            "draft_server_queue_depth", "Requests waiting for the batcher", registry=registry
        )
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0

    def record_batch(
        self, prompts: Sequence[Sequence[int]], drafts: Sequence[draft_model.Draft], seconds: float
    ) -> None:
        self.batch_size.observe(len(prompts))
        self.batch_seconds.observe(seconds)
        # Lookup drafts never reach the model or its cache: counting them would skew the cached share.
        prompt_tokens = sum(len(prompt) for prompt, draft in zip(prompts, drafts) if draft.source == "model")
        cached_tokens = sum(draft.cached_tokens for draft in drafts)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.draft_tokens.inc(sum(len(draft) for draft in drafts))
        self.lookup_drafts.inc(sum(draft.source == "lookup" for draft in drafts))
        self.total_prompt_tokens += prompt_tokens
        self.total_cached_tokens += cached_tokens
        if self.total_prompt_tokens:
            self.cached_ratio.set(self.total_cached_tokens / self.total_prompt_tokens)

    content_type = prometheus_client.CONTENT_TYPE_LATEST

    def text(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
