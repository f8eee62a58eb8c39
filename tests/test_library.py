"""Ollama library names (issue 22, parts 1 and 2): the packaged table, how names resolve, a user's
own file, and the names where a model is named (``vllama serve --model``, ``[[models]]``, requests
through the real ``ollama`` client against the stand-in ``vllm``). Pulls of library names are in
``test_pull.py`` (they need the fake Hub)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from ollama import Client, ResponseError

from conftest import ROOT, resolved_specs
from vllama_proxy.errors import ModelNotFound
from vllama_proxy.models import library, library_check, library_schema
from vllama_proxy.models.library_schema import LibraryError
from vllama_proxy.settings import Settings

MY_ROW = '''
[[model]]
name = "qwen2.5"
default_tag = "7b"
family = "qwen2"
capabilities = ["completion", "tools"]
context_length = 32768
tool_call_parser = "hermes"
reasoning_parser = ""
vllm_args = []
sources = ["https://huggingface.co/my-org/qwen2.5-7b-ft"]
  [[model.tag]]
  tag = "7b"
  aliases = ["7b-instruct"]
  repo = "my-org/qwen2.5-7b-ft"
  revision = "v2"
  parameters = "7B"
  context_length = 32768
  quant.q4 = { repo = "my-org/qwen2.5-7b-ft", kind = "unquantized", fallback = true }
  quant.q8 = { repo = "my-org/qwen2.5-7b-ft", kind = "unquantized", fallback = true }
  quant.fp16 = { repo = "my-org/qwen2.5-7b-ft", kind = "unquantized", fallback = false }

[[model]]
name = "house-embed"
default_tag = "small"
family = "bert"
capabilities = ["embedding"]
context_length = 512
tool_call_parser = ""
reasoning_parser = ""
vllm_args = ["--runner", "pooling"]
sources = ["https://huggingface.co/my-org/house-embed-small"]
  [[model.tag]]
  tag = "small"
  aliases = []
  repo = "my-org/house-embed-small"
  revision = "main"
  parameters = "33M"
  context_length = 512
  quant.q4 = { repo = "my-org/house-embed-small", kind = "unquantized", fallback = true }
  quant.q8 = { repo = "my-org/house-embed-small", kind = "unquantized", fallback = true }
  quant.fp16 = { repo = "my-org/house-embed-small", kind = "unquantized", fallback = false }
'''


@pytest.fixture(scope="module")
def lib() -> library.Library:
    return library.load()


# ---------------------------------------------------------------------------- the table


def test_packaged_table_keeps_its_schema_and_every_row_is_sourced():
    doc = library_schema.read_file(library_schema.PACKAGED)
    errors, warnings = library_check.strict_problems(doc)
    assert errors == [] and warnings == []
    assert len(doc.model) >= 40 and sum(len(m.tag) for m in doc.model) >= 200
    for m in doc.model:  # Ollama's page and the card of every repo served for a plain tag
        assert f"https://ollama.com/library/{m.name}" in m.sources
        assert all(f"https://huggingface.co/{t.repo}" in m.sources for t in m.tag), m.name
    names = {m.name for m in doc.model}
    assert {"llama3.2", "qwen2.5", "qwen3", "gemma3", "mistral", "phi4", "deepseek-r1", "gpt-oss", "nomic-embed-text",
            "mxbai-embed-large", "bge-m3", "all-minilm", "snowflake-arctic-embed"} <= names
    assert library_check.main([]) == 0  # the check a contributor runs (docs/library.md)


def test_the_table_ships_with_the_package():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"vllama_proxy.models" = ["library.toml"]' in text


def _row(**change) -> dict:
    tag = {"tag": "7b", "aliases": ["7b-instruct"], "repo": "org/m-7b", "revision": "main", "parameters": "7B",
           "context_length": 4096, "quant": {c: {"repo": "org/m-7b", "kind": "unquantized", "fallback": c != "fp16"}
                                             for c in ("q4", "q8", "fp16")}}
    row = {"name": "m", "default_tag": "7b", "family": "llama", "capabilities": ["completion", "tools"],
           "context_length": 4096, "tool_call_parser": "hermes", "reasoning_parser": "", "vllm_args": [],
           "sources": ["https://ollama.com/library/m", "https://huggingface.co/org/m-7b"], "tag": [tag]}
    for key, value in change.items():
        target, _, field = key.partition("__")
        (tag if field else row)[field or target] = value
    return row


@pytest.mark.parametrize("change,message", [
    ({"default_tag": "8b"}, "default_tag '8b' is not one of its tags"),
    ({"capabilities": ["completion"]}, "tool_call_parser must be set if and only if 'tools'"),
    ({"capabilities": ["embedding"], "tool_call_parser": ""}, "needs --runner pooling"),
    ({"capabilities": ["completion", "tools", "smell"]}, "none of completion"),
    ({"colour": "blue"}, "Extra inputs are not permitted"),
    ({"sources": ["http://ollama.com/library/m"]}, "https URLs"),
    ({"tag__repo": "not-a-repo"}, "is not owner/name"),
    ({"tag__tag": "latest"}, "never 'latest'"),
    ({"tag__context_length": 0}, "greater than 0"),
    ({"tag__quant": {"q4": {"repo": "org/m-7b-AWQ", "kind": "awq", "fallback": True},
                     "q8": {"repo": "org/m-7b", "kind": "unquantized", "fallback": True},
                     "fp16": {"repo": "org/m-7b", "kind": "unquantized", "fallback": False}}}, "a fallback but names another repo"),
    ({"tag__quant": {"q4": {"repo": "org/m-7b", "kind": "int3", "fallback": True}}}, "kind 'int3' is none of"),
])
def test_schema_refuses_a_broken_row(tmp_path, change, message):
    import json

    doc = {"schema_version": 1, "model": [_row(**change)]}
    path = tmp_path / "library.toml"
    path.write_text(_toml(doc))
    with pytest.raises(library_schema.LibraryError) as e:
        library_schema.read_file(path)
    assert message in str(e.value) and "library.toml: m" in str(e.value), (json.dumps(change), str(e.value))


def test_strict_check_wants_ollamas_page_and_known_parsers(tmp_path):
    path = tmp_path / "library.toml"
    path.write_text(_toml({"schema_version": 1, "model": [_row(sources=["https://huggingface.co/org/m-7b"], tool_call_parser="nonesuch")]}))
    errors, _ = library_check.strict_problems(library_schema.read_file(path))
    assert "m: sources lack https://ollama.com/library/m" in errors and "m: unknown tool_call_parser 'nonesuch'" in errors


def _toml(doc: dict) -> str:
    """Just enough TOML for these documents (no TOML writer in the standard library)."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, str)):
            return repr(v).replace("'", '"') if isinstance(v, str) else str(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"

    out = [f"{k} = {value(v)}" for k, v in doc.items() if k != "model"]
    for m in doc["model"]:
        out.append("[[model]]")
        out += [f"{k} = {value(v)}" for k, v in m.items() if k != "tag"]
        for t in m["tag"]:
            out.append("[[model.tag]]")
            out += [f"{k} = {value(v)}" for k, v in t.items()]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("name,canonical,repo,quant,kind,fallback", [
    ("llama3.2", "llama3.2:3b", "meta-llama/Llama-3.2-3B-Instruct", None, None, False),  # no tag: Ollama's default
    ("llama3.2:latest", "llama3.2:3b", "meta-llama/Llama-3.2-3B-Instruct", None, None, False),
    ("llama3.2:1b", "llama3.2:1b", "meta-llama/Llama-3.2-1B-Instruct", None, None, False),  # a size tag
    ("qwen2.5:7b", "qwen2.5:7b", "Qwen/Qwen2.5-7B-Instruct", None, None, False),
    ("qwen2.5:0.5b", "qwen2.5:0.5b", "Qwen/Qwen2.5-0.5B-Instruct", None, None, False),
    ("qwen2.5:72b", "qwen2.5:72b", "Qwen/Qwen2.5-72B-Instruct", None, None, False),
    ("qwen2.5:7b-instruct", "qwen2.5:7b", "Qwen/Qwen2.5-7B-Instruct", None, None, False),  # an alias
    ("Qwen2.5:7B-Instruct", "qwen2.5:7b", "Qwen/Qwen2.5-7B-Instruct", None, None, False),  # any case, as Ollama
    # quantization suffixes: the publisher's own quantized repo where it ships one ...
    ("qwen2.5:7b-instruct-q4_K_M", "qwen2.5:7b-q4_K_M", "Qwen/Qwen2.5-7B-Instruct-AWQ", "q4", "awq", False),
    ("qwen2.5:7b-instruct-q8_0", "qwen2.5:7b-q8_0", "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "q8", "gptq-int8", False),
    ("qwen2.5:q4_0", "qwen2.5:7b-q4_0", "Qwen/Qwen2.5-7B-Instruct-AWQ", "q4", "awq", False),  # a bare suffix: the default tag's
    ("qwen2.5:7b-instruct-fp16", "qwen2.5:7b-fp16", "Qwen/Qwen2.5-7B-Instruct", "fp16", "unquantized", False),
    # ... else the plain repo, saying so
    ("llama3.1:8b-instruct-q4_K_M", "llama3.1:8b-q4_K_M", "meta-llama/Llama-3.1-8B-Instruct", "q4", "unquantized", True),
    ("nomic-embed-text", "nomic-embed-text:v1.5", "nomic-ai/nomic-embed-text-v1.5", None, None, False),
])
def test_names_resolve(lib, name, canonical, repo, quant, kind, fallback):
    e = lib.resolve(name)
    assert (e.name, e.repo, e.quant, e.quant_kind, e.fallback) == (canonical, repo, quant, kind, fallback)


def test_an_entry_carries_what_vllm_needs(lib):
    e = lib.resolve("qwen2.5:7b")
    assert (e.family, e.parameters, e.context_length, e.revision) == ("qwen2", "7B", 32768, "main")
    assert e.capabilities == ("completion", "tools")
    assert e.vllm_args() == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert "--reasoning-parser" in lib.resolve("deepseek-r1:8b").vllm_args()
    gpt = lib.resolve("gpt-oss").vllm_args()
    assert gpt == ["--enable-auto-tool-choice", "--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss"]
    assert lib.resolve("nomic-embed-text").vllm_args()[:2] == ["--runner", "pooling"]
    # a chat template from vLLM's source tree is named, but not passed: the wheel does not ship it
    llama = lib.resolve("llama3.1")
    assert llama.chat_template.startswith("examples/") and "--chat-template" not in llama.vllm_args()


def test_a_tags_own_field_overrides_the_rows(lib):
    """The rule written once (``Model.served_by``): deepseek-r1's 671b tag sets its own family,
    capabilities, tool parser and vllm_args; a field it leaves unset, and every field of the
    other tags, is the row's."""
    big, small = lib.resolve("deepseek-r1:671b"), lib.resolve("deepseek-r1:8b")
    assert (big.family, big.capabilities, big.tool_call_parser) == ("deepseek2", ("completion", "tools", "thinking"), "deepseek_v3")
    assert big.extra_args == ("--trust-remote-code", "--enable-expert-parallel") and big.reasoning_parser == "deepseek_r1"
    assert (small.capabilities, small.tool_call_parser, small.extra_args) == (("completion", "thinking"), "", ())
    row = lib.model("deepseek-r1")
    assert row.served_by(None).capabilities == tuple(row.capabilities) == ("completion", "thinking")


def test_unknown_names_say_what_is_close(lib):
    with pytest.raises(ModelNotFound) as e:
        lib.resolve("lama3.2")
    assert e.value.status == 404
    assert e.value.message.startswith("model 'lama3.2' not found: it is not a name in vllama's library")
    assert "the closest known names are llama3.2, " in e.value.message
    assert "a Hugging Face model is named by its id, org/name" in e.value.message
    with pytest.raises(ModelNotFound) as e:
        lib.resolve("qwen2.5:99b")
    assert "knows qwen2.5 with the tags 0.5b, 1.5b, 3b, 7b, 14b, 32b, 72b and latest (= 7b)" in e.value.message
    with pytest.raises(ModelNotFound):
        lib.resolve("qwen2.5:7b-q9_Z")  # not a quantization suffix
    with pytest.raises(ModelNotFound):
        lib.resolve("Qwen/Qwen2.5-7B-Instruct")  # a Hugging Face id is no library name
    assert "qwen2.5:7b" in lib and "qwen2.5:99b" in lib and "Qwen/Qwen2.5-7B-Instruct" not in lib


def test_a_users_file_replaces_and_adds_rows(tmp_path):
    user = tmp_path / "library.toml"
    user.write_text(MY_ROW)
    lib = library.load(user)
    assert lib.replaced == ["qwen2.5"] and lib.added == ["house-embed"]
    mine = lib.resolve("qwen2.5:7b-instruct")
    assert mine.repo == "my-org/qwen2.5-7b-ft" and "--revision" in mine.vllm_args()
    with pytest.raises(ModelNotFound):  # the row is replaced whole: the packaged 0.5b is gone
        lib.resolve("qwen2.5:0.5b")
    assert lib.resolve("house-embed:latest").repo == "my-org/house-embed-small"
    assert lib.resolve("llama3.2").repo == "meta-llama/Llama-3.2-3B-Instruct"  # the rest stays
    assert library.load().resolve("qwen2.5:7b").repo == "Qwen/Qwen2.5-7B-Instruct"  # the packaged table is untouched


def test_settings_read_the_users_file(tmp_path):
    user = tmp_path / "mine.toml"
    user.write_text(MY_ROW)
    s = Settings(model="house-embed", library=user, state_dir=tmp_path / "state")
    (spec,) = resolved_specs(s)
    assert (spec.model, spec.served_name, spec.args()) == ("my-org/house-embed-small", "house-embed", ["--runner", "pooling"])
    # without --library: <state_dir>/library.toml when it exists
    state = tmp_path / "state2"
    state.mkdir()
    (state / "library.toml").write_text(MY_ROW)
    (spec,) = resolved_specs(Settings(model="qwen2.5:7b", state_dir=state))
    assert spec.model == "my-org/qwen2.5-7b-ft" and spec.args()[-2:] == ["--revision", "v2"]
    (spec,) = resolved_specs(Settings(model="qwen2.5:7b", state_dir=tmp_path / "empty"))
    assert spec.model == "Qwen/Qwen2.5-7B-Instruct"
    broken = tmp_path / "broken.toml"
    broken.write_text(MY_ROW.replace('default_tag = "small"', 'default_tag = "big"'))
    with pytest.raises(LibraryError, match="house-embed: default_tag 'big' is not one of its tags"):
        resolved_specs(Settings(model="house-embed", library=broken, state_dir=tmp_path / "state"))
    with pytest.raises(LibraryError, match="No such file"):
        resolved_specs(Settings(library=tmp_path / "absent.toml", state_dir=tmp_path / "state"))


# ---------------------------------------------------------------------------- serve --model and [[models]]


def _spec(**kw):
    (spec,) = resolved_specs(Settings(state_dir=Path("/nonexistent/vllama-state"), **kw))
    return spec


def test_model_specs_resolve_library_names():
    spec = _spec(model="qwen2.5:7b")
    assert (spec.model, spec.served_name) == ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5:7b")
    assert spec.args() == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert _spec(model="llama3.2:latest").served_name == "llama3.2"  # listed as llama3.2:latest
    assert _spec(model="qwen2.5:7b", served_model_name="q").served_name == "q"
    spec = _spec(models=[{"model": "llama3.2", "name": "house", "aliases": ["l3"], "max_model_len": 8192}])
    assert (spec.model, spec.served_name, spec.aliases, spec.max_model_len) == ("meta-llama/Llama-3.2-3B-Instruct", "house", ["l3"], 8192)
    assert spec.args() == ["--max-model-len", "8192", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    spec = _spec(models=[{"model": "nomic-embed-text"}])
    assert spec.args() == ["--runner", "pooling", "--trust-remote-code"]


def test_the_users_vllm_flags_win_and_are_never_doubled():
    args = _spec(model="qwen2.5:0.5b", vllm_args=["--tool-call-parser", "pythonic", "--max-model-len", "2048"]).args()
    assert args == ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic", "--max-model-len", "2048"]
    args = _spec(model="nomic-embed-text", vllm_args=["--trust-remote-code", "--runner=pooling"]).args()
    assert args == ["--trust-remote-code", "--runner=pooling"]
    args = _spec(models=[{"model": "deepseek-r1:8b", "reasoning_parser": "qwen3"}]).args()
    assert args.count("--reasoning-parser") == 1 and args[args.index("--reasoning-parser") + 1] == "qwen3"


def test_hub_ids_paths_and_other_names_stay_as_they_are(tmp_path):
    assert _spec(model="Qwen/Qwen2.5-7B-Instruct").args() == []
    assert _spec(model="Qwen/Qwen2.5-7B-Instruct").served_name == "Qwen/Qwen2.5-7B-Instruct"
    local = tmp_path / "qwen2.5"  # a directory that happens to carry a library name
    local.mkdir()
    spec = _spec(model=str(local))
    assert (spec.model, spec.served_name, spec.args()) == (str(local), "qwen2.5", [])
    assert _spec(model="gpt2").model == "gpt2"  # not in the table, no tag: vLLM decides, as before


def test_an_unknown_tag_is_a_settings_error():
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--model", "qwen2.5:99b", "--no-gpu-check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "model 'qwen2.5:99b' not found: vllama's library knows qwen2.5 with the tags" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--model", "lama3.2:3b", "--no-gpu-check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "the closest known names are llama3.2" in r.stderr, r.stderr


def _vllm_cmdline(v) -> list[str]:
    cmdline = psutil.Process(v.server_pid()).cmdline()
    return cmdline[cmdline.index("serve"):]


def test_serve_a_library_name(vllama):
    v = vllama(model="qwen2.5:0.5b")
    v.wait_state("ready")
    cmd = _vllm_cmdline(v)
    assert cmd[1] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cmd[cmd.index("--served-model-name") + 1] == "qwen2.5:0.5b"
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes" and cmd.count("--enable-auto-tool-choice") == 1
    client = Client(host=v.url)
    assert [m.model for m in client.list().models] == ["qwen2.5:0.5b"]
    for name in ("qwen2.5:0.5b", "qwen2.5:0.5b-instruct", "Qwen2.5:0.5B"):  # its tag, an alias, any case
        r = client.chat(model=name, messages=[{"role": "user", "content": "hi"}], stream=False)
        assert r.model == name and r.message.content.startswith("tok0")
    assert client.show("qwen2.5:0.5b").capabilities == ["completion", "tools"]
    with pytest.raises(ResponseError) as e:
        client.show("qwen2.5:7b")
    assert e.value.status_code == 404 and "maps it to Qwen/Qwen2.5-7B-Instruct, which is not pulled here; try pulling it first" in e.value.error
    with pytest.raises(ResponseError) as e:
        client.chat(model="qwen2.5:0.6b", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "knows qwen2.5 with the tags" in e.value.error
    with pytest.raises(ResponseError) as e:
        client.generate(model="qwen25", prompt="x")
    assert e.value.status_code == 404 and "closest known names are qwen2.5:0.5b" in e.value.error and "org/name" in e.value.error
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "show", "qwen2.5:0.5b-instruct", "--host", v.url], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "tools" in r.stdout, r.stderr
    assert v.stop() == 0


def test_the_logged_library_flags_are_the_launched_ones(vllama):
    """The start-up ``library_model`` line shows the flags vLLM gets, the user's parser and flags
    included (it showed the library's own, hermes here, while pythonic was launched)."""
    v = vllama(model="qwen2.5:0.5b", vllm_args=["--tool-call-parser", "pythonic", "--max-model-len", "2048"])
    v.wait_state("ready")
    cmd = _vllm_cmdline(v)
    (line,) = [json.loads(x) for x in v.log.read_text().splitlines() if '"library_model"' in x]
    assert line["vllm_args"] == ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic", "--max-model-len", "2048"]
    launched = cmd[cmd.index("--served-model-name") + 2:]
    assert launched[-len(line["vllm_args"]):] == line["vllm_args"]


def test_a_library_name_finds_the_model_served_by_its_hub_id(vllama):
    v = vllama(model="Qwen/Qwen2.5-0.5B-Instruct")
    v.wait_state("ready")
    assert _vllm_cmdline(v)[1] == "Qwen/Qwen2.5-0.5B-Instruct" and "--tool-call-parser" not in _vllm_cmdline(v)
    client = Client(host=v.url)
    r = client.generate(model="qwen2.5:0.5b", prompt="x", stream=False)
    assert r.model == "qwen2.5:0.5b" and r.done
    assert client.show("qwen2.5:0.5b-instruct").capabilities == ["completion"]  # served as started: no tool flags
    assert httpx.post(v.url + "/api/pull", json={"model": "qwen2.5:0.5b", "stream": False}).json() == {"status": "success"}
    assert v.stop() == 0


def test_models_table_with_a_library_name(vllama):
    v = vllama(config='[[models]]\nmodel = "llama3.2"\nvllm_args = ["--tool-call-parser", "pythonic"]\n')
    v.wait_state("ready")
    cmd = _vllm_cmdline(v)
    assert cmd[1] == "meta-llama/Llama-3.2-3B-Instruct" and cmd[cmd.index("--served-model-name") + 1] == "llama3.2"
    assert cmd.count("--tool-call-parser") == 1 and cmd[cmd.index("--tool-call-parser") + 1] == "pythonic"
    client = Client(host=v.url)
    assert [m.model for m in client.list().models] == ["llama3.2:latest"]
    for name in ("llama3.2", "llama3.2:latest", "llama3.2:3b"):
        assert client.generate(model=name, prompt="x", stream=False).done
    assert v.stop() == 0
