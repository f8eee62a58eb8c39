"""Many users on one server (issue 27): what a lookup may not do, what a key may do, who used what.

``vllama serve`` with the stand-in vLLM as its ``vllm``, on-demand models laid out in a Hugging Face
cache as ``huggingface_hub`` leaves them (``test_on_demand.place``), or pulled from the fake Hub.
"""

from __future__ import annotations

import httpx
import ollama
import pytest

from test_on_demand import hub, place, serve  # noqa: F401 - fixtures
from test_pull import fake_hf, hf_env  # noqa: F401 - the fake Hub fixture


def _log(s) -> list[dict]:
    import json
    return [json.loads(x) for x in s.log.read_text().splitlines() if x.startswith("{")]


# -- 1. looking a model up never loads it -----------------------------------------------------

def test_metadata_calls_never_load_or_evict_a_model(serve, hub, fake_hf):  # noqa: F811
    for repo in ("acme/tiny-a", "acme/tiny-b"):
        place(hub, repo)
    s = serve("--max-on-demand", "1", "--keep-alive", "-1",
              env={**hf_env(fake_hf.url, hub.parent), "HF_HUB_CACHE": str(hub)})
    assert s.client.generate(model="acme/tiny-a", prompt="x", options={"num_predict": 1}).done
    assert [a[2] for a in s.launched()] == ["acme/tiny-a"]
    # what Open WebUI and editor plugins sweep: tags, then show of each model
    names = [m.model for m in s.client.list().models]
    assert "acme/tiny-b:latest" in names
    for n in names:
        assert s.client.show(n).details.family == "qwen2"
    assert "completion" in s.client.show("acme/tiny-b").capabilities
    assert httpx.get(s.url + "/v1/models/acme/tiny-b").json()["id"] == "acme/tiny-b"
    s.client.copy("acme/tiny-b", "bee")
    assert s.client.show("bee").details.family == "qwen2"
    assert s.client.pull("acme/tiny-b").status == "success"  # already local: verified, nothing loaded
    s.client.delete("bee")
    # an unload of a model nothing holds loads nothing
    r = httpx.post(s.url + "/api/generate", json={"model": "acme/tiny-b", "keep_alive": 0}).json()
    assert r["done_reason"] == "unload"
    assert [a[2] for a in s.launched()] == ["acme/tiny-a"]  # b was never started, a never evicted
    assert [m.model for m in s.client.ps().models] == ["acme/tiny-a:latest"]
    assert not [x for x in _log(s) if x.get("event") == "on_demand_unload"]
    # an explicit load (empty prompt) and inference do claim a slot
    assert httpx.post(s.url + "/api/generate", json={"model": "acme/tiny-b"}, timeout=60).json()["done_reason"] == "load"
    assert [a[2] for a in s.launched()] == ["acme/tiny-a", "acme/tiny-b"]


def test_rm_of_a_pulled_model_not_serving_works_and_a_served_repo_is_refused_by_any_revision(serve, hub, tmp_path):
    place(hub, "acme/tiny-prod")
    place(hub, "acme/tiny-old")
    place(hub, "acme/tiny-used")
    s = serve("--model", "acme/tiny-prod", "--keep-alive", "-1")
    s.wait_ready()
    s.client.delete("acme/tiny-old")  # ollama rm of a pulled model no one uses
    assert not (hub / "models--acme--tiny-old").exists()
    for name in ("acme/tiny-prod", "acme/tiny-prod:main", "acme/tiny-prod:latest", "ACME/tiny-prod:main"):
        with pytest.raises(ollama.ResponseError) as e:
            s.client.delete(name)
        assert e.value.status_code == 400 and "in use" in e.value.error, name
    assert (hub / "models--acme--tiny-prod").exists()
    assert s.client.generate(model="acme/tiny-used", prompt="x", options={"num_predict": 1}).done
    for name in ("acme/tiny-used", "acme/tiny-used:main"):
        with pytest.raises(ollama.ResponseError) as e:
            s.client.delete(name)
        assert e.value.status_code == 400, name
    assert (hub / "models--acme--tiny-used").exists()


# -- 2. aliases -------------------------------------------------------------------------------

def test_an_alias_cannot_take_a_name_a_pull_fetches_and_their_number_is_capped(serve, hub, tmp_path):
    place(hub, "acme/tiny-prod")
    s = serve("--model", "acme/tiny-prod", "--max-aliases", "2")
    s.wait_ready()
    for dest in ("acme/tiny-c", "qwen2.5:0.5b"):
        r = httpx.post(s.url + "/api/copy", json={"source": "acme/tiny-prod", "destination": dest})
        assert r.status_code == 400 and "pull" in r.json()["error"], dest
    s.client.copy("acme/tiny-prod", "one")
    s.client.copy("acme/tiny-prod", "two")
    s.client.copy("acme/tiny-prod", "two")  # replacing an alias is not one more
    r = httpx.post(s.url + "/api/copy", json={"source": "acme/tiny-prod", "destination": "three"})
    assert r.status_code == 400 and "--max-aliases" in r.json()["error"]
    assert {m.model for m in s.client.list().models} == {"acme/tiny-prod:latest", "one:latest", "two:latest"}


# -- 4. operator arguments and on-demand models --------------------------------------------------

def test_trust_remote_code_never_reaches_a_model_the_operator_did_not_name(serve, hub):
    place(hub, "acme/tiny-prod")
    place(hub, "acme/tiny-evil")
    s = serve("--model", "acme/tiny-prod", "--", "--trust-remote-code", "--load-format", "pt", "--max-num-seqs", "8",
              "--hf-overrides={}", "--enforce-eager")
    s.wait_ready()
    assert s.client.generate(model="acme/tiny-evil", prompt="x", options={"num_predict": 1}).done
    prod, evil = s.launched()
    assert prod[2] == "acme/tiny-prod" and "--trust-remote-code" in prod and "pt" in prod  # the operator's model: as given
    assert evil[2] == "acme/tiny-evil"
    assert not {"--trust-remote-code", "--load-format", "pt", "--hf-overrides={}"} & set(evil)
    assert evil[evil.index("--max-num-seqs") + 1] == "8" and "--enforce-eager" in evil  # sizing and tuning: kept
    assert any(x.get("event") == "on_demand_args_left_out" for x in _log(s))
