"""Prometheus metrics of a server (`GET /metrics`), in a registry of its own
so that several servers in one process (tests) do not collide."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MEMORY_EVERY_S = 0.25  # the pools are read at most this often (the prefix index is walked to count its pages)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("hybridspec_requests_running", "requests generating (a token out already)", registry=r)
        self.waiting = Gauge("hybridspec_requests_waiting", "requests waiting for their first token", registry=r)
        self.prompt_tokens = Counter("hybridspec_prompt_tokens", "prompt tokens taken in", registry=r)
        self.generation_tokens = Counter("hybridspec_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter("hybridspec_requests_finished", "requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.engine_failures = Counter("hybridspec_engine_failures", "engine steps that raised", registry=r)
        self.acceptance = Gauge("hybridspec_acceptance_rate", "accepted / drafted tokens since start", registry=r)
        self.gamma = Histogram("hybridspec_gamma", "drafts asked for per sequence-round (γ)",
                               buckets=tuple(range(0, 17)), registry=r)
        self.preemptions = Counter("hybridspec_preemptions", "running requests preempted", registry=r)
        self.prefix_hit_tokens = Counter("hybridspec_prefix_cache_hit_tokens", "prompt tokens found in the prefix "
                                         "cache", registry=r)
        self.ttft = Histogram("hybridspec_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hybridspec_inter_token_latency_seconds", "time between tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_pages_used = Gauge("hybridspec_kv_pages_used", "KV pages in use", ["model"], registry=r)
        self.kv_pages_free = Gauge("hybridspec_kv_pages_free", "KV pages free", ["model"], registry=r)
        self.rings_used = Gauge("hybridspec_state_rings_used", "state rings in use", ["model"], registry=r)
        self.prefix_cache_bytes = Gauge("hybridspec_prefix_cache_bytes", "bytes the prefix cache holds", ["model"],
                                        registry=r)
        self._seen = {"drafted": 0, "accepted": 0, "preemptions": 0, "prefix": 0, "gammas": {}}
        self._memory_at = 0.0

    def finished(self, reason: str | None) -> None:
        self.requests.labels(reason or "unknown").inc()

    def observe_engine(self, engine, num_requests: int, num_waiting: int) -> None:
        """After a step: the engine's counters since the last call, its pools now."""
        stats, seen = engine.total_stats, self._seen
        self.preemptions.inc(stats.preemptions - seen["preemptions"])
        self.prefix_hit_tokens.inc(stats.prefix_hit_tokens - seen["prefix"])
        for g, count in stats.gamma_counts.items():
            for _ in range(count - seen["gammas"].get(g, 0)):
                self.gamma.observe(g)
        seen.update(drafted=stats.drafted_tokens, accepted=stats.accepted_tokens, preemptions=stats.preemptions,
                    prefix=stats.prefix_hit_tokens, gammas=dict(stats.gamma_counts))
        self.acceptance.set(stats.acceptance_rate)
        self.running.set(max(0, num_requests - num_waiting))
        self.waiting.set(num_waiting)
        if time.monotonic() - self._memory_at >= MEMORY_EVERY_S or num_requests == 0:
            self._memory_at = time.monotonic()
            self.observe_memory(engine.memory())

    def observe_memory(self, memory) -> None:
        for name, cache in (("target", memory.target), ("drafter", memory.drafter)):
            if cache is None:
                continue
            self.kv_pages_used.labels(name).set(cache.kv_pages_used)
            self.kv_pages_free.labels(name).set(cache.kv_pages_free)
            self.rings_used.labels(name).set(cache.rings_used)
            self.prefix_cache_bytes.labels(name).set(cache.prefix_cache_bytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
