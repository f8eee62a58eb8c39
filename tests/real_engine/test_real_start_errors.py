"""A start of the real vLLM that can never succeed fails at once, with vLLM's own reason in one line.

A model neither cached nor reachable (the tier runs with ``HF_HUB_OFFLINE=1``, as a host with no network
is): vLLM 0.32 raises huggingface_hub's ``LocalEntryNotFoundError`` and exits 1. vllama retried that as a
crash, for minutes, and said only ``vLLM exited with code 1``; now the first start ends ``vllama serve``
with exit 2 and the reason (``supervisor/start_errors.py``).
"""

from __future__ import annotations

from pathlib import Path

from .conftest import START_TIMEOUT


def test_a_model_that_cannot_be_had_stops_vllama_at_once_with_vllms_reason(start_real):
    v = start_real("not-cached", model=Path("acme/never-cached-model"))
    assert v.proc.wait(timeout=START_TIMEOUT) == 2, v.tail()
    log = v.log.read_text()
    assert log.count('"launched"') == 1, v.tail()  # started once, never restarted
    line = next(ln for ln in log.splitlines() if ln.startswith("vllama serve: "))
    assert "model 'acme/never-cached-model'" in line and "vLLM cannot load the model: LocalEntryNotFoundError: " in line, line
