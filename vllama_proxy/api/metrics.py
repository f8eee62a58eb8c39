"""Prometheus metrics of the proxy (prometheus-client), served at ``GET /metrics``.

TTFT and TPOT as Ollama clients see them (measured at the proxy, per route, once per request: a
per-token metric would cost the streaming hot path more than the translation; vLLM's ITL histogram is
at ``/vllm/metrics``, vLLM's own metrics relayed), requests by route and status, in flight, queue
rejections, upstream errors by kind, the supervisor's state and restarts. With ``--workers N`` every
process writes to ``PROMETHEUS_MULTIPROC_DIR`` (set by the CLI before prometheus-client is imported)
and a scrape of any worker aggregates them: prometheus-client's multiprocess mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import os

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from vllama_proxy.ipc.lock import this_pid
from vllama_proxy.supervisor.states import State
from vllama_proxy.models.boards import EngineBoard
from .ollama.timestamps import Timings

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # prometheus-client's multiprocess values ask os.getpid() on every inc/observe, a system call
    # each (22 per request with --workers 2); its documented process_identifier reads it once.
    values.ValueClass = values.MultiProcessValue(process_identifier=this_pid)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

REQUESTS = Counter("vllama_requests", "HTTP requests answered, by route and status.", ["route", "status"])
IN_FLIGHT = Gauge("vllama_requests_in_flight", "Inference requests being answered now.", multiprocess_mode="livesum")
QUEUE_REJECTIONS = Counter("vllama_queue_rejections", "Requests answered 503 server busy because --max-queue was reached.")
UPSTREAM_ERRORS = Counter("vllama_upstream_errors", "Failures talking to vLLM, by kind.", ["kind"])
CLIENT_WRITE_STALLS = Counter("vllama_client_write_stalls", "Client connections closed because a write to them waited "
                              "--client-write-timeout seconds with no byte read by the client (its request ended as if it "
                              "had left), by route.", ["route"])
STATE_STORE_ERRORS = Counter("vllama_state_store_errors", "Calls to the --state-url store (Redis) that failed, or were "
                             "skipped while it was down: each front applied its own per-key limits meanwhile.")
RESUMED_STREAMS = Counter("vllama_resumed_streams", "Streams asked again of vLLM after it broke mid-answer and continued, "
                          "and non-streamed /v1 requests asked again whole "
                          "(api/request/resume.py), by route; each resume counts once.", ["route"])
RESUME_PROMPT_TOKENS = Counter("vllama_resume_prompt_tokens", "Prompt tokens of those resumes (the client's prompt and "
                               "the output already sent, asked again): vllama's cost, charged to no key.", ["route"])
TTFT = Histogram("vllama_time_to_first_token_seconds", "Time from request received to first token written, Ollama side.", ["route"], buckets=_LATENCY_BUCKETS)
TPOT = Histogram("vllama_time_per_output_token_seconds",
                 "Per request: time from the first to the last output token over output tokens - 1, Ollama side.",
                 ["route"], buckets=_TPOT_BUCKETS)

_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0, 8.0)
#: Where a request's time goes inside vllama: seconds from the moment the outermost
#: middleware saw it to the end of each stage, once per Ollama generate/chat request.
STAGE = Histogram("vllama_request_stage_seconds",
                  "Per request: seconds from accepted (outermost middleware) to the end of each stage: handler (the "
                  "middlewares: CORS, API key, readiness, admission), parsed (body parsed, model resolved, vLLM body "
                  "built: sent upstream), upstream_headers (vLLM's response headers), first_upstream_data (first body read), "
                  "first_client_write (first NDJSON line written; streamed answers only).",
                  ["stage"], buckets=_STAGE_BUCKETS)
STAGES = ("handler", "parsed", "upstream_headers", "first_upstream_data", "first_client_write")
#: The stage histogram's children, bound once (``labels`` per request would cost a dict lookup each).
_STAGE_CHILDREN = tuple(STAGE.labels(s) for s in STAGES)
#: Who used what: per key name (never the secret; ``-`` on an open server, ``(none)`` for no known key) and
#: served model (``-`` before one was resolved: a refusal).
KEY_REQUESTS = Counter("vllama_key_requests", "Inference requests, by key name, served model and status class "
                       "(refused ones too: model '-' when refused before a model was resolved).", ["key", "model", "status"])
KEY_PROMPT_TOKENS = Counter("vllama_key_prompt_tokens", "Prompt tokens of answered requests, by key name and model.",
                            ["key", "model"])
KEY_OUTPUT_TOKENS = Counter("vllama_key_output_tokens", "Output tokens of answered requests, by key name and model.",
                            ["key", "model"])


def observe_key_usage(key: str, model: str, status: int, usage: tuple[int, int] | None) -> None:
    """Count one inference request under its key and model, with its ``(prompt, output)`` tokens
    (once, by the settler: ``settler.py``)."""
    KEY_REQUESTS.labels(key, model, f"{status // 100}xx").inc()
    if usage is not None:
        KEY_PROMPT_TOKENS.labels(key, model).inc(usage[0])
        KEY_OUTPUT_TOKENS.labels(key, model).inc(usage[1])


def observe_stages(accepted: int, t: Timings, first_write: int) -> None:
    """One request's stage timings (:data:`STAGE`), seconds since ``accepted``, the moment the outermost
    middleware saw it (``app_state.ACCEPTED``; ns, ``time.perf_counter_ns``); ``first_write`` 0: not
    streamed (no first_client_write)."""
    marks = (t.received, t.sent, t.headers, t.first_read, first_write)
    for child, mark in zip(_STAGE_CHILDREN, marks):
        if mark:
            child.observe((mark - accepted) / 1e9)


def observe_tpot(route: str, t: Timings, tokens: int) -> None:
    """TPOT of one finished request: first to last token (``t``, ns) over its ``tokens`` output tokens - 1."""
    if tokens > 1 and t.last > t.first:
        TPOT.labels(route).observe((t.last - t.first) / 1e9 / (tokens - 1))


class SupervisorCollector:
    """Per model: ``vllama_supervisor_state{model,state}`` (1 for the current state),
    ``vllama_supervisor_restarts_total{model}`` and ``vllama_model_requests_in_flight{model}``."""

    def __init__(self, boards: Sequence[EngineBoard]) -> None:
        self._boards = boards

    def collect(self):
        state = GaugeMetricFamily("vllama_supervisor_state", "Supervisor state of each model's vLLM: 1 for the current one.", labels=["model", "state"])
        restarts = CounterMetricFamily("vllama_supervisor_restarts", "Times each model's vLLM was restarted by the supervisor.", labels=["model"])
        in_flight = GaugeMetricFamily("vllama_model_requests_in_flight", "Requests using each model now, over all workers.", labels=["model"])
        for board in self._boards:
            if not board.served_name:
                continue  # an on-demand slot no model has taken yet
            current = board.state
            for s in State:
                state.add_metric([board.served_name, s.value], 1.0 if s is current else 0.0)
            restarts.add_metric([board.served_name], float(board.restarts))
            in_flight.add_metric([board.served_name], float(board.in_flight))
        yield state
        yield restarts
        yield in_flight


def make_handler(boards: Sequence[EngineBoard]):
    """The ``GET /metrics`` handler: this process's (or all workers') metrics plus the supervisor's."""
    extra = CollectorRegistry(auto_describe=True)
    if boards:
        extra.register(SupervisorCollector(boards))

    async def metrics(request: web.Request) -> web.Response:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        else:
            registry = REGISTRY
        body = generate_latest(registry) + generate_latest(extra)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return metrics


def route_of(request: web.Request) -> str:
    """A bounded label for the route: its pattern (``/v1/{tail}``), or ``other``."""
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else "other"
