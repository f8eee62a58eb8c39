"""An on-demand model whose start vLLM refuses, on the real vLLM: the request that asked for it gets
vLLM's reason at once, the other models keep serving (``supervisor/start_errors.py``; the first start
of a configured model: ``test_real_start_errors.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ollama
import pytest

from .conftest import BASE_ARGS, START_TIMEOUT


def _cache(v, repo: str, model: Path, **config) -> None:
    """Put ``model`` in ``v``'s Hugging Face cache as ``repo`` (a snapshot and ``refs/main``, as vLLM loads
    offline), its config.json updated with ``config``."""
    owner, name = repo.split("/")
    root = v.tmp / "hf" / "hub" / f"models--{owner}--{name}"
    snapshot = root / "snapshots" / ("0" * 40)
    shutil.copytree(model, snapshot, ignore=shutil.ignore_patterns("DONE"))
    if config:
        path = snapshot / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)


def test_an_on_demand_model_vllm_refuses_answers_its_request_with_the_reason_and_the_others_serve(start_real, tiny_model):
    """Two pulled models served on demand; vLLM refuses the second's configuration (its context,
    2,048 as every server here asks, is over the 1,024 positions its config.json declares). The request
    that asked for it gets vLLM's reason in its 503 after that one launch, and the first keeps serving."""
    v = start_real("on-demand-refused", config="", vllm_args=BASE_ARGS)
    _cache(v, "acme/tiny-qwen", tiny_model)
    _cache(v, "acme/tiny-short", tiny_model, max_position_embeddings=1024)
    v.wait_live()
    client = ollama.Client(host=v.url, timeout=2 * START_TIMEOUT)
    assert client.generate(model="acme/tiny-qwen", prompt="hi", options={"num_predict": 3}).eval_count == 3
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="acme/tiny-short", prompt="hi", options={"num_predict": 3})
    assert refused.value.status_code == 503
    error = refused.value.error
    assert error.startswith("model 'acme/tiny-short' failed to load: vLLM refused its configuration: "), error
    assert "User-specified max_model_len (2048) is greater than the derived max_model_len (max_position_embeddings=1024" in error
    assert "\n" not in error
    text = v.log.read_text(errors="replace")
    launched = [json.loads(x)["argv"][2] for x in text.splitlines() if '"launched"' in x]
    assert launched == ["acme/tiny-qwen", "acme/tiny-short"], launched  # refused once, never restarted
    assert client.generate(model="acme/tiny-qwen", prompt="hi", options={"num_predict": 2}).eval_count == 2
    assert v.proc.poll() is None
