"""Prometheus metrics of the server (``GET /metrics``), on a registry of its own.

Request metrics are observed by the routes: time to first token and per output token for every
answered completion, streamed or not (the routes take tokens as the engine makes them); engine state (queue depth, running
sequences, resident models) and the engine's cumulative counters (swaps, swap
seconds and bytes, preemptions, steps) are read from ``engine.snapshot()`` and
``engine.counters()`` at scrape time, so they cannot drift from the engine's own.
"""
from __future__ import annotations

from typing import Any, Dict

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; TTFT and end-to-end include swaps (tens of ms to seconds), per-token is ms-scale
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

OUTCOMES = {200: "ok", 400: "bad_request", 401: "unauthorized", 404: "unknown_model", 429: "queue_full",
            499: "cancelled", 500: "error", 503: "engine_dead", 504: "timeout"}


def outcome(status: int) -> str:
    return OUTCOMES.get(status, str(status))


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("computron_requests", "HTTP inference requests by model, endpoint and outcome",
                                ["model", "endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("computron_prompt_tokens", "Prompt tokens of answered requests",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("computron_generation_tokens", "Tokens generated for answered requests",
                                         ["model"], registry=r)
        self.ttft = Histogram("computron_time_to_first_token_seconds", "Request arrival to its first output token",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("computron_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request",
                              ["model"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("computron_e2e_request_latency_seconds", "Request arrival to its last token",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine))

    def request_done(self, model: str, endpoint: str, status: int) -> None:
        self.requests.labels(model, endpoint, outcome(status)).inc()

    def tokens(self, model: str, prompt: int, generated: int) -> None:
        self.prompt_tokens.labels(model).inc(prompt)
        self.generation_tokens.labels(model).inc(generated)

    def latency(self, model: str, ttft: float, e2e: float, n_tokens: int) -> None:
        if n_tokens:
            self.ttft.labels(model).observe(ttft)
            if n_tokens > 1:
                self.tpot.labels(model).observe((e2e - ttft) / (n_tokens - 1))
        self.e2e.labels(model).observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine state and cumulative counters, read when scraped."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        e = self.engine
        alive = GaugeMetricFamily("computron_engine_alive", "1 while the engine serves, 0 once dead or shut down")
        alive.add_metric([], 1.0 if e.is_alive else 0.0)
        yield alive
        snap: Dict[str, Any] = e.snapshot()
        depth = GaugeMetricFamily("computron_queue_depth", "Requests waiting per model", labels=["model"])
        running = GaugeMetricFamily("computron_running_sequences", "Sequences running per model", labels=["model"])
        resident = GaugeMetricFamily("computron_model_resident", "1 if the model is loaded on the devices",
                                     labels=["model"])
        state = GaugeMetricFamily("computron_model_state", "1 for the model's current state", labels=["model", "state"])
        n_resident = 0
        for m, s in snap["models"].items():
            depth.add_metric([m], s.get("waiting", 0))
            running.add_metric([m], s.get("running", 0))
            is_res = s.get("state") == "loaded"
            n_resident += is_res
            resident.add_metric([m], 1.0 if is_res else 0.0)
            state.add_metric([m, str(s.get("state"))], 1.0)
        total = GaugeMetricFamily("computron_resident_models", "Models loaded on the devices")
        total.add_metric([], n_resident)
        yield from (depth, running, resident, state, total)
        c = e.counters()
        models = list(snap["models"])  # zeros for what has not happened yet: every series exists from the start
        swaps = CounterMetricFamily("computron_swaps", "Loads and offloads", labels=["model", "kind"])
        secs = CounterMetricFamily("computron_swap_seconds", "Seconds spent in loads and offloads",
                                   labels=["model", "kind"])
        nbytes = CounterMetricFamily("computron_swap_bytes", "Bytes moved by loads and offloads",
                                     labels=["model", "kind"])
        for fam, key in ((swaps, "swaps"), (secs, "swap_seconds"), (nbytes, "swap_bytes")):
            values = {(m, k): 0 for m in models for k in ("load", "offload")}
            values.update(c.get(key, {}))
            for (m, kind), v in sorted(values.items()):
                fam.add_metric([m, kind], v)
            yield fam
        pre = CounterMetricFamily("computron_preemptions", "Sequences preempted to swap their model out",
                                  labels=["model"])
        for m, v in sorted({**dict.fromkeys(models, 0), **c.get("preemptions", {})}.items()):
            pre.add_metric([m], v)
        yield pre
        steps = CounterMetricFamily("computron_steps", "Batches or decode steps run", labels=["model"])
        for m, v in sorted({**dict.fromkeys(models, 0), **c.get("steps", {})}.items()):
            steps.add_metric([m], v)
        yield steps
