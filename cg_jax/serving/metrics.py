"""The server's Prometheus metrics, in a registry of their own."""


from __future__ import annotations

import math
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from cg_jax.engine import Engine
from cg_jax.handles import Completion

# Seconds the first token and each next one may take: the histograms' buckets.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)



# --------------------------------------------------------------------------------------------------
# Metrics


class EngineGauges:
  """Gauges read from `engine.stats()` at each scrape: queue depth, running requests, compiles
  since warm-up, decode steps on stand-ins and every numeric `kv_block*` (the paged cache's
  blocks: its use) and `prefix_cache_*` entry."""

  GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
      "waiting": ("cg_jax_requests_waiting", "requests in the engine's waiting queue"),
      "running": ("cg_jax_requests_running", "requests running (each holds its KV blocks)"),
      "compiles_since_warmup": ("cg_jax_compiles_since_warmup",
                                "XLA compilations after warm-up (0 when serving)"),
      "steps_on_stand_ins": ("cg_jax_steps_on_stand_ins",
                             "decode steps on their stand-ins until their own executables are "
                             "built behind the warm-up (0 when serving at full speed)")}

  def __init__(self, engine: Engine):
    self.engine = engine

  def collect(self):
    stats = self.engine.stats()
    for key, (name, help_text) in self.GAUGES.items():
      if is_number(stats.get(key)):
        yield GaugeMetricFamily(name, help_text, value=stats[key])
    for key, value in stats.items():
      if key.startswith(("prefix_cache_", "kv_block")) and is_number(value):
        yield GaugeMetricFamily(f"cg_jax_{key}", f"engine.stats()[{key!r}]", value=value)


def is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Metrics:
  """The app's Prometheus metrics, in a registry of its own."""

  def __init__(self, engine: Engine):
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("cg_jax_http_requests", "HTTP requests by endpoint and status",
                            ("endpoint", "status"), registry=r)
    self.prompt_tokens = Counter("cg_jax_prompt_tokens", "prompt tokens of accepted requests",
                                 registry=r)
    self.generated_tokens = Counter("cg_jax_generation_tokens", "tokens of the finished requests",
                                    registry=r)
    self.cancelled = Counter("cg_jax_requests_cancelled",
                             "requests cancelled because their client disconnected", registry=r)
    self.ttft = Histogram("cg_jax_time_to_first_token_seconds",
                          "submit to first token, per request", buckets=TTFT_BUCKETS, registry=r)
    self.tpot = Histogram("cg_jax_time_per_output_token_seconds",
                          "seconds per token after the first, per request", buckets=TPOT_BUCKETS,
                          registry=r)
    self.duration = Histogram("cg_jax_request_duration_seconds",
                              "submit to last token, per request", buckets=DURATION_BUCKETS,
                              registry=r)
    r.register(EngineGauges(engine))

  def finished(self, completion: Completion) -> None:
    stats = completion.stats
    self.generated_tokens.inc(len(completion.tokens))
    if stats.get("ttft_s") is not None:
      self.ttft.observe(stats["ttft_s"])
    if stats.get("per_token_s") is not None and len(completion.tokens) > 1:
      self.tpot.observe(stats["per_token_s"])
    if stats.get("total_s") is not None:
      self.duration.observe(stats["total_s"])

  def text(self) -> bytes:
    return generate_latest(self.registry)


class CountRequests:
  """ASGI middleware: counts each HTTP request by endpoint (unknown paths as "other") and the
  status it was answered with."""

  def __init__(self, app, metrics: Metrics, endpoints: frozenset[str]):
    self.app, self.metrics, self.endpoints = app, metrics, endpoints

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      await self.app(scope, receive, send)
      return
    status = [500]

    async def watch(message):
      if message["type"] == "http.response.start":
        status[0] = message["status"]
      await send(message)

    try:
      await self.app(scope, receive, watch)
    finally:
      path = scope.get("path", "")
      endpoint = path if path in self.endpoints else "other"
      self.metrics.requests.labels(endpoint, str(status[0])).inc()
