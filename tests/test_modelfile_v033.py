"""Ollama 0.33's Modelfile commands (``models/modelfile_v033.py``): ``DRAFT`` and ``PARAMETER draft_num_predict``
start the base's vLLM with ``--speculative-config``; ``REQUIRES`` is checked against the Ollama level vllama
speaks; ``RENDERER`` and ``PARSER`` are taken where the base's template and parsers are their counterparts.

The stand-in vLLM records its argv (``launched`` events), so a test sees the very ``--speculative-config``
vLLM would parse; the real vLLM's speculative decoding is measured on the GPU (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest

from conftest import ROOT, SERVED, log_events
from vllama_proxy import read_modelfile
from vllama_proxy.errors import BadRequest
from vllama_proxy.models.created import CreatedModel, render_modelfile
from vllama_proxy.models.adapters import lora_plan
from vllama_proxy.models.model_files import read_model_files
from vllama_proxy.models.modelfile_v033 import check_parser, check_renderer, check_requires, speculative_json


def _spec(argv: list[str]) -> dict | None:
    return json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else None


def test_the_modelfile_commands_are_read_kept_and_written_back():
    text = ("FROM base\nDRAFT ngram\nREQUIRES 0.14.0\nRENDERER qwen3\nPARSER qwen3\nSYSTEM hi\n"
            "PARAMETER draft_num_predict 6\nPARAMETER temperature 0.5\n")
    fields = read_modelfile(text)
    assert (fields["draft"], fields["requires"], fields["renderer"], fields["parser"]) == ("ngram", "0.14.0", "qwen3", "qwen3")
    made = CreatedModel(name="m", base="b", parent="base", system="hi", parameters={"temperature": 0.5}, draft="ngram",
                        draft_num_predict=6, requires="0.14.0", renderer="qwen3", parser="qwen3")
    again = read_modelfile(render_modelfile(made))
    assert {k: again[k] for k in ("draft", "requires", "renderer", "parser", "system")} == {
        "draft": "ngram", "requires": "0.14.0", "renderer": "qwen3", "parser": "qwen3", "system": "hi"}
    assert again["parameters"] == {"temperature": 0.5, "draft_num_predict": 6}
    # a model made before these fields keeps its digest
    old = CreatedModel(name="m", base="b", parent="base", system="s")
    before = {k: v for k, v in old.model_dump(exclude={"created_at"}).items()
              if k not in ("draft", "draft_num_predict", "requires", "renderer", "parser")}
    assert old.digest == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()


def test_the_speculative_config_is_vllms_json():
    assert json.loads(speculative_json("ngram", 5)) == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                                         "prompt_lookup_min": 2}
    assert json.loads(speculative_json("Qwen/Qwen3-0.6B", None)) == {"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4}
    plan = lora_plan([CreatedModel(name="m", base="b", parent="b", draft="ngram", draft_num_predict=3)], "b")
    assert plan.args()[:1] == ["--speculative-config"] and _spec(plan.args())["num_speculative_tokens"] == 3
    assert not lora_plan([CreatedModel(name="m", base="b", parent="b", draft="ngram")], "other").args()
    # the names vLLM's SpeculativeConfig has (vllm/config/speculative.py)
    vllm_config = pytest.importorskip("vllm.config.speculative")
    fields = set(vllm_config.SpeculativeConfig.__dataclass_fields__)
    assert {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"} <= fields


def test_requires_and_parser_checks():
    assert check_requires("v0.14.0") == "0.14.0" and check_requires("0.33.0") == "0.33.0"
    with pytest.raises(BadRequest, match="requires Ollama 0.99.0 or later; vllama speaks Ollama's API at level 0.33.0"):
        check_requires("0.99.0")
    with pytest.raises(BadRequest, match="valid semver"):
        check_requires("soon")
    assert check_parser("qwen3", ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]) == "qwen3"
    with pytest.raises(BadRequest, match="PARSER harmony is vLLM's --tool-call-parser openai, but the base model's vLLM runs with hermes"):
        check_parser("harmony", ["--tool-call-parser", "hermes"])


def test_a_renderer_is_taken_where_the_template_is_of_its_family():
    files = read_model_files(str(ROOT / "tests" / "assets" / "tool-model"), "tool-model")  # Qwen's: <tool_call>, <think>
    assert check_renderer("qwen3", files) == "qwen3" and check_renderer("qwen3-vl-instruct", files) == "qwen3-vl-instruct"
    with pytest.raises(BadRequest, match="RENDERER harmony"):
        check_renderer("harmony", files)


def _create(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/api/create", json={"stream": False, **body}, timeout=60)


def test_requires_renderer_and_parser_over_http(proxy):
    r = _create(proxy.url, model="future", **{"from": SERVED}, requires="0.99.0")
    assert r.status_code == 400 and "requires Ollama 0.99.0 or later" in r.json()["error"]
    r = _create(proxy.url, model="newer", modelfile=f"FROM {SERVED}\nREQUIRES 0.99.1\n")
    assert r.status_code == 400 and "0.99.1" in r.json()["error"]
    # the stand-in stack's model runs --tool-call-parser hermes --reasoning-parser qwen3: Ollama's qwen3 parser
    r = _create(proxy.url, model="parsed", modelfile=f"FROM {SERVED}\nREQUIRES 0.20.0\nPARSER qwen3\n")
    assert r.status_code == 200, r.text
    shown = httpx.post(proxy.url + "/api/show", json={"model": "parsed"}).json()
    assert (shown["requires"], shown["parser"]) == ("0.20.0", "qwen3")
    assert "REQUIRES 0.20.0" in shown["modelfile"] and "PARSER qwen3" in shown["modelfile"]
    httpx.request("DELETE", proxy.url + "/api/delete", json={"model": "parsed"}).raise_for_status()  # the proxy is shared
    # its chat template has no tool or thinking markers: no renderer's family
    r = _create(proxy.url, model="rendered", **{"from": SERVED}, renderer="qwen3")
    assert r.status_code == 400 and "vLLM renders this model with its own chat template" in r.json()["error"]
    r = _create(proxy.url, model="harm", **{"from": SERVED}, parser="harmony")
    assert r.status_code == 400 and "--tool-call-parser openai" in r.json()["error"]
    r = _create(proxy.url, model="odd", **{"from": SERVED}, renderer="no-such-renderer")
    assert r.status_code == 400 and "has no counterpart in vLLM" in r.json()["error"]


def test_a_draft_needs_a_vllm_that_vllama_launches(proxy):
    r = _create(proxy.url, model="fast", modelfile=f"FROM {SERVED}\nDRAFT ngram\n")
    assert r.status_code == 400 and "--upstream" in r.json()["error"]
    r = _create(proxy.url, model="fast", modelfile=f"FROM {SERVED}\nPARAMETER draft_num_predict 4\n")
    assert r.status_code == 400 and "needs a DRAFT" in r.json()["error"]
    r = _create(proxy.url, model="fast", **{"from": SERVED}, draft="ngram", draft_quantize="q4_K_M")
    assert r.status_code == 400 and "draft_quantize is not supported" in r.json()["error"]


def test_a_draft_model_restarts_its_base_with_the_speculative_config(vllama):
    v = vllama()
    base = v.wait_state("ready")["model"]
    first = [e["argv"] for e in log_events(v.log) if e.get("event") == "launched"]
    assert first and _spec(first[-1]) is None
    r = _create(v.url, model="quick", modelfile=f"FROM {base}\nDRAFT ngram\nPARAMETER draft_num_predict 5\nSYSTEM be brief\n")
    assert r.status_code == 200, r.text
    argv = [e["argv"] for e in log_events(v.log) if e.get("event") == "launched"][-1]
    assert len([e for e in log_events(v.log) if e.get("event") == "launched"]) == len(first) + 1  # restarted once
    assert _spec(argv) == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    chat = httpx.post(v.url + "/api/chat", json={"model": "quick", "messages": [{"role": "user", "content": "hi"}], "stream": False},
                      timeout=60)
    assert chat.status_code == 200 and chat.json()["message"]["content"]
    shown = httpx.post(v.url + "/api/show", json={"model": "quick"}).json()
    assert "DRAFT ngram" in shown["modelfile"] and "PARAMETER draft_num_predict 5" in shown["modelfile"]
    # one draft per base: another is refused; the same one is not, and restarts nothing
    r = _create(v.url, model="other", **{"from": base}, draft="org/draft-model")
    assert r.status_code == 400 and "already runs with another draft" in r.json()["error"]
    r = _create(v.url, model="quick2", modelfile=f"FROM {base}\nDRAFT ngram\nPARAMETER draft_num_predict 5\n")
    assert r.status_code == 200, r.text
    assert len([e for e in log_events(v.log) if e.get("event") == "launched"]) == len(first) + 1
