"""Prometheus metrics of the API server, in a private registry (one server per process).

Timing is measured in the API server when outputs arrive from the engine (not when a client
reads them), per engine request (a request with n > 1 has n): time to first token from arrival,
inter-token latency between successive outputs, and request latency until the finish.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shardserve.messages import EngineCoreOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)


@dataclass
class _Timing:
    arrival: float
    last: float | None = None  # when the last output arrived


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Gauges per data-parallel replica (label `engine`, its index); counters summed.
        self.running = Gauge("shardserve:num_requests_running",
                             "Requests in the running batch.", ["engine"], registry=r)
        self.waiting = Gauge("shardserve:num_requests_waiting",
                             "Requests waiting to be scheduled.", ["engine"], registry=r)
        self.kv_usage = Gauge("shardserve:kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (0 to 1).", ["engine"],
                              registry=r)
        self.preemptions = Gauge("shardserve:num_preemptions",
                                 "Preemptions since start.", ["engine"], registry=r)
        self.kv_capacity = Gauge("shardserve:kv_cache_capacity_tokens",
                                 "Tokens the KV cache holds (blocks x block_size x decode "
                                 "context parallel size).", ["engine"], registry=r)
        self.replicas = Gauge("shardserve:data_parallel_size",
                              "Engine replicas serving requests.", registry=r)
        self.prompt_tokens = Counter("shardserve:prompt_tokens",
                                     "Prompt tokens of requests received.", registry=r)
        self.generation_tokens = Counter("shardserve:generation_tokens",
                                         "Tokens generated.", registry=r)
        self.rejected = Counter("shardserve:requests_rejected", "Requests refused before "
                                "reaching the engine.", ["reason"], registry=self.registry)
        self.finished = Counter("shardserve:request_success", "Finished engine requests.",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("shardserve:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("shardserve:inter_token_latency_seconds",
                             "Time between successive generated tokens of a request.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("shardserve:e2e_request_latency_seconds",
                             "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prefix_queries = Counter("shardserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("shardserve:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.", registry=r)
        # Speculative decoding, vLLM's counters (vllm:spec_decode_*) under our prefix.
        self.spec_drafts = Counter("shardserve:spec_decode_num_drafts",
                                   "Verify steps of a request with at least one draft.",
                                   registry=r)
        self.spec_draft_tokens = Counter("shardserve:spec_decode_num_draft_tokens",
                                         "Draft tokens verified.", registry=r)
        self.spec_accepted = Counter("shardserve:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.", registry=r)
        self.spec_accepted_per_pos = Counter(
            "shardserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft of a step).",
            ["position"], registry=r)
        # Recovery (a dead replica restarted, its requests moved to a serving one).
        self.engine_restarts = Counter("shardserve:engine_restarts",
                                       "Restarts of a replica that died.", ["engine"],
                                       registry=r)
        self.requests_migrated = Counter("shardserve:requests_migrated",
                                         "Requests moved off a dead replica to another.",
                                         registry=r)
        self.requests_failed_after_migration = Counter(
            "shardserve:requests_failed_after_migration",
            "Requests of a dead replica ended with an error (out of migrations or replicas).",
            registry=r)
        self._prefix_seen: dict[int, tuple[int, int]] = {}  # each engine's totals last applied
        self._spec_seen: dict[int, tuple[int, int, int, list[int]]] = {}  # the same, spec
        self._labelled: set[int] = set()  # replicas with gauges
        self._timings: dict[str, _Timing] = {}

    @property
    def _engine_gauges(self) -> tuple[Gauge, ...]:
        return (self.running, self.waiting, self.kv_usage, self.preemptions, self.kv_capacity)

    def set_replicas(self, serving: int, indices: list[int]) -> None:
        """How many replicas serve, and the live replicas' gauges (zero until one reports;
        a replica no longer live loses its gauges)."""
        self.replicas.set(serving)
        for i in self._labelled - set(indices):
            self.remove_replica(i)
        for i in indices:
            for gauge in self._engine_gauges:
                gauge.labels(engine=str(i))
            self.engine_restarts.labels(engine=str(i))  # 0 before the first: rate() sees it
        self._labelled = set(indices)

    def remove_replica(self, index: int) -> None:
        """A replica that stopped (scaled down): its gauges go; the counters keep its work."""
        for gauge in self._engine_gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(str(index))
        self._prefix_seen.pop(index, None)
        self._spec_seen.pop(index, None)
        self._labelled.discard(index)

    def on_stats(self, engine: int, stats) -> None:
        label = str(engine)
        self.running.labels(engine=label).set(stats.num_running)
        self.waiting.labels(engine=label).set(stats.num_waiting)
        self.kv_usage.labels(engine=label).set(stats.kv_cache_usage)
        self.preemptions.labels(engine=label).set(stats.num_preemptions)
        self.kv_capacity.labels(engine=label).set(stats.kv_cache_capacity_tokens)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        seen_queries, seen_hits = self._prefix_seen.get(engine, (0, 0))
        self.prefix_queries.inc(max(0, queries - seen_queries))
        self.prefix_hits.inc(max(0, hits - seen_hits))
        self._prefix_seen[engine] = (queries, hits)
        self._on_spec_stats(engine, stats)

    def _on_spec_stats(self, engine: int, stats) -> None:
        """The counters grow by what the replica's totals grew since it last reported."""
        now = (stats.spec_num_drafts, stats.spec_num_draft_tokens,
               stats.spec_num_accepted_tokens, list(stats.spec_accepted_per_pos))
        seen = self._spec_seen.get(engine, (0, 0, 0, []))
        for counter, new, old in zip((self.spec_drafts, self.spec_draft_tokens,
                                      self.spec_accepted), now[:3], seen[:3], strict=True):
            counter.inc(max(0, new - old))
        for pos, count in enumerate(now[3]):
            old = seen[3][pos] if pos < len(seen[3]) else 0
            self.spec_accepted_per_pos.labels(position=str(pos)).inc(max(0, count - old))
        self._spec_seen[engine] = now

    def on_request_added(self, engine_ids: list[str], num_prompt_tokens: int) -> None:
        now = time.monotonic()
        self.prompt_tokens.inc(num_prompt_tokens)
        for rid in engine_ids:
            self._timings[rid] = _Timing(now)

    def on_outputs(self, outputs: list[EngineCoreOutput], now: float) -> None:
        for out in outputs:
            timing = self._timings.get(out.request_id)
            if timing is None:
                continue
            n = len(out.new_token_ids)
            self.generation_tokens.inc(n)
            if timing.last is None:
                self.ttft.observe(now - timing.arrival)
            elif n:
                self.itl.observe((now - timing.last) / n)
            timing.last = now
            if out.finished:
                self._finish(out.request_id, out.finish_reason or "stop", now)

    def on_rejected(self, reason: str) -> None:
        """A request refused before it reached the engine (e.g. "queue_full")."""
        self.rejected.labels(reason=reason).inc()

    def on_finished(self, engine_ids: list[str], reason: str) -> None:
        """Requests that ended outside the engine's outputs: aborts, stop strings."""
        now = time.monotonic()
        for rid in engine_ids:
            self._finish(rid, reason, now)

    def on_engine_restart(self, engine: int) -> None:
        self.engine_restarts.labels(engine=str(engine)).inc()
        # The restarted replica counts its totals from 0 again.
        self._prefix_seen.pop(engine, None)
        self._spec_seen.pop(engine, None)

    def on_requests_migrated(self, count: int) -> None:
        self.requests_migrated.inc(count)

    def on_requests_failed_after_migration(self, count: int) -> None:
        self.requests_failed_after_migration.inc(count)

    def _finish(self, rid: str, reason: str, now: float) -> None:
        timing = self._timings.pop(rid, None)
        if timing is None:
            return
        self.finished.labels(finished_reason=reason).inc()
        self.e2e.observe(now - timing.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
