"""``deploy/grafana/vllama.json`` (issue 39) queries only metrics that exist: every ``vllama_*`` name
its PromQL uses is one vllama exports (``vllama_proxy/api/metrics.py``, read from prometheus-client's
registry and the supervisor collector), every ``vllm:*`` name one vLLM 0.32 defines
(``tests/fixtures/vllm-0.32/metric_names.txt``, read from vLLM's source). And it shows each thing the
issue names: requests and tokens per key and model, TTFT and ITL, the queue, admission, GPU KV
cache use, model states."""

from __future__ import annotations

import json
import re

from conftest import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "vllama.json"
_NAME = re.compile(r"\b(vllama_[a-z_]+|vllm:[a-z_:]+)")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def _exprs(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return out


def _vllama_names() -> set[str]:
    """What ``/metrics`` can show: each family of the registry (its samples' names) and the supervisor's."""
    from prometheus_client import REGISTRY, Counter, Histogram

    import vllama_proxy.api.metrics as metrics

    names: set[str] = set()
    for obj in vars(metrics).values():
        if isinstance(obj, Counter):
            names |= {obj._name + "_total"}
        elif isinstance(obj, Histogram):
            names |= {obj._name + s for s in ("_bucket", "_sum", "_count")}
        elif hasattr(obj, "_name") and hasattr(obj, "_type"):
            names.add(obj._name)
    assert REGISTRY  # the same objects the registry serves
    source = (ROOT / "vllama_proxy" / "api" / "metrics.py").read_text()
    for kind, name in re.findall(r"(Gauge|Counter)MetricFamily\(\"(\w+)\"", source):
        names.add(name + ("_total" if kind == "Counter" else ""))
    return names


def _vllm_names() -> set[str]:
    lines = (ROOT / "tests" / "fixtures" / "vllm-0.32" / "metric_names.txt").read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ours, vllm = _vllama_names(), _vllm_names()
    assert "vllama_key_requests_total" in ours and "vllama_supervisor_state" in ours and "vllm:kv_cache_usage_perc" in vllm
    unknown = []
    for expr in _exprs(dashboard):
        for name in _NAME.findall(expr):
            if name.startswith("vllama_"):
                ok = name in ours
            else:
                base = next((name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)), name)
                ok = base in vllm or name in vllm
            if not ok:
                unknown.append(f"{name} in {expr}")
    assert not unknown, "the dashboard queries metrics nobody exports:\n" + "\n".join(unknown)


def test_the_dashboard_shows_what_an_operator_asks() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    text = " ".join(_exprs(dashboard))
    for needed in ("vllama_key_requests_total", "vllama_key_prompt_tokens_total", "vllama_key_output_tokens_total",
                   "vllama_time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:num_requests_waiting", "vllama_queue_rejections_total", "vllm:kv_cache_usage_perc",
                   "vllama_supervisor_state"):
        assert needed in text, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"]
