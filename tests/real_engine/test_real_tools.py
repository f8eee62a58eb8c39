"""Tool calls and thinking through vLLM's own parsers on CPU (issue 21): the issue-13 transcript.

The shipped tool model (``tests/assets/tool-model``, trained on the GPU: its README says how)
writes hermes ``<tool_call>`` blocks, ``<think>`` blocks and JSON. vllama supervises the real
``vllm serve`` with ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser
qwen3`` and the transcript of ``benchmarks/tool_model/e2e_tools.py`` (the real ``ollama``
client; langchain-ollama's steps too where it is installed) must come out right, step by step,
as it did through vLLM 0.26 on the H200 (``benchmarks/RESULTS.md``). The flags are not given: vllama
tells them from the model's chat template (``models/family.py``; the session's ``tool_server``).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
from .conftest import ROOT, TOOL_NAME, RealVllama

sys.path.insert(0, str(ROOT / "benchmarks" / "tool_model"))
import e2e_tools  # noqa: E402

NAME = TOOL_NAME


@pytest.fixture
def server(tool_server) -> RealVllama:
    return tool_server  # the session's; its parsers told by its chat template


def test_the_issue_13_transcript_through_vllms_parsers(server):
    t = e2e_tools.Transcript()
    e2e_tools.ollama_steps(t, server.url, NAME)
    if importlib.util.find_spec("langchain_ollama") is not None:
        e2e_tools.langchain_steps(t, server.url, NAME)
    wrong = [(s["step"], s["result"][:300]) for s in t.steps if not s["right"]]
    assert len(t.steps) >= 15
    assert wrong == [], f"{len(t.steps) - len(wrong)}/{len(t.steps)} steps right"
