"""Prometheus metrics, one registry per application (two servers in one process never share).

Names are ``tandem_*``; the prefix-cache counters count tokens as vLLM's
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` do, so dashboards built
for those read ours.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                  300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tandem_requests", "Requests answered, by route and status.",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens",
                                     "Prompt tokens of requests that ran.", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens",
                                         "Tokens generated.", registry=r)
        self.prefix_cache_queries = Counter(
            "tandem_prefix_cache_queries",
            "Prompt tokens looked up in the prefix caches (tokens).", registry=r)
        self.prefix_cache_hits = Counter(
            "tandem_prefix_cache_hits",
            "Prompt tokens found in the prefix caches, not prefilled again (tokens).",
            registry=r)
        self.spec_drafted = Counter(
            "tandem_spec_draft_tokens", "Tokens the lookup drafter proposed.", registry=r)
        self.spec_accepted = Counter(
            "tandem_spec_accepted_tokens",
            "Drafted tokens the verify blocks accepted (over drafted: the acceptance rate).",
            registry=r)
        self.finished = Counter("tandem_generations_finished",
                                "Generations that ended, by finish reason.",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated token.",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.request_duration = Histogram("tandem_request_duration_seconds",
                                          "Seconds from a request's arrival to its last byte.",
                                          buckets=TTFT_BUCKETS_S, registry=r)
        self.decode_tok_s = Histogram("tandem_decode_tokens_per_second",
                                      "Decode speed of each generation.",
                                      buckets=(1, 5, 10, 25, 50, 100, 200, 400, 800),
                                      registry=r)
        self._gauges: list[Gauge] = []

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read when scraped (the engine's rows in place, requests waiting)."""
        g = Gauge(name, doc, registry=self.registry)
        g.set_function(read)
        self._gauges.append(g)

    def render(self) -> bytes:
        return generate_latest(self.registry)
