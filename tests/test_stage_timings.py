"""Where a request's time goes inside vllama (issue 28): ``vllama_request_stage_seconds{stage}``.

Each Ollama generate/chat request is observed once per stage, every stage counted from the
moment the outermost middleware saw it, so per request the stages can only grow in order.
"""

from __future__ import annotations

import re

import httpx
import ollama

from conftest import ALIAS, start_proxy, stop

STAGES = ("handler", "parsed", "upstream_headers", "first_upstream_data", "first_client_write")


def stage_sums(url: str) -> dict[str, tuple[float, float]]:
    """stage -> (count, sum) from /metrics."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for stage in STAGES:
        c = re.search(rf'vllama_request_stage_seconds_count{{stage="{stage}"}} (\S+)', text)
        s = re.search(rf'vllama_request_stage_seconds_sum{{stage="{stage}"}} (\S+)', text)
        out[stage] = (float(c.group(1)) if c else 0.0, float(s.group(1)) if s else 0.0)
    return out


def test_stages_of_streamed_and_whole_answers(fake):
    p = start_proxy(fake.url, "--workers", "1")
    try:
        client = ollama.Client(host=p.url)
        for _ in range(3):
            assert list(client.generate(model=ALIAS, prompt="hi [[tokens:3]]", stream=True))[-1].done
        s = stage_sums(p.url)
        assert {k: v[0] for k, v in s.items()} == dict.fromkeys(STAGES, 3.0)
        sums = [s[k][1] for k in STAGES]
        assert all(0 < a <= b for a, b in zip(sums, sums[1:])), sums  # each stage ends after the one before
        assert sums[-1] < 3 * 5.0
        # a whole answer (stream: false): every stage but the first client write
        assert client.chat(model=ALIAS, messages=[{"role": "user", "content": "hi"}], stream=False).done
        s = stage_sums(p.url)
        assert {k: v[0] for k, v in s.items()} == {**dict.fromkeys(STAGES, 4.0), "first_client_write": 3.0}
    finally:
        stop(p.proc)
