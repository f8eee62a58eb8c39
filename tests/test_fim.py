"""Fill-in-the-middle (issue 30): ``suffix`` on /api/generate becomes the model family's FIM prompt.

Through the real ollama client, vllama and the fake vLLM serving a model whose tokenizer has
Qwen2.5-Coder's FIM tokens; the rule for which model has which format is checked on the library
table itself. The real vLLM's side is in ``tests/real_engine/test_real_fim.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from ollama import ResponseError

from conftest import SERVED, start_fake, start_proxy, stop, write_model_dir, _requests_of
from vllama_proxy.models import library
from vllama_proxy.models.fim import fim_format
from vllama_proxy.models.model_files import read_model_files

QWEN_FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def add_tokens(path: Path, tokens: list[str], first_id: int = 900) -> Path:
    """A ``tokenizer.json`` whose added tokens are ChatML's plus ``tokens`` (ids from ``first_id``)."""
    base = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = [{"id": first_id + i, "content": t, "special": True} for i, t in enumerate(base + tokens)]
    (path / "tokenizer.json").write_text(json.dumps({"added_tokens": added, "model": {"type": "BPE", "vocab": {"a": 0}}}))
    return path


@pytest.fixture(scope="module")
def fim_proxy(tmp_path_factory):
    model = add_tokens(write_model_dir(tmp_path_factory.mktemp("fim") / "coder"), QWEN_FIM)
    fake = start_fake(model)
    proxy = start_proxy(fake.url)
    yield proxy, fake
    stop(proxy.proc)
    stop(fake.proc)


def test_suffix_reaches_completions_as_the_fim_prompt(fim_proxy):
    import ollama

    proxy, fake = fim_proxy
    received = _requests_of(fake)
    client = ollama.Client(host=proxy.url)
    assert "insert" in client.show(SERVED).capabilities
    r = client.generate(model=SERVED, prompt="def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))", system="ignored",
                        options={"stop": ["\n\n"], "num_predict": 5}, stream=False)
    assert r.done and r.response
    (sent,) = received("/v1/completions")
    body = sent["body"]
    assert body["prompt"] == "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n\nprint(add(1, 2))<|fim_middle|>"
    assert body["max_tokens"] == 5
    ids = {t: 900 + i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *QWEN_FIM])}
    # the family's stop tokens by id (the tokenizer has them all), the client's own stop kept
    assert body["stop_token_ids"] == [ids[t] for t in library.load().fim["qwen"].stop]
    assert body["stop"] == ["\n\n"]
    assert received("/v1/chat/completions") == []


def test_fim_refusals(fim_proxy):
    import ollama

    client = ollama.Client(host=fim_proxy[0].url)
    for kw, words in [({"raw": True}, "raw mode does not support suffix"), ({"context": [1, 2]}, "context is not supported with suffix")]:
        with pytest.raises(ResponseError) as e:
            client.generate(model=SERVED, prompt="a", suffix="b", **kw)
        assert e.value.status_code == 400 and words in e.value.error


def test_context_is_refused_not_ignored(client, upstream_requests):
    with pytest.raises(ResponseError) as e:
        client.generate(model=SERVED, prompt="and then?", context=[1, 2, 3])
    assert e.value.status_code == 400 and "context is not supported" in e.value.error
    assert upstream_requests("/v1/chat/completions") == []
    # an empty context is nothing to ignore
    assert client.generate(model=SERVED, prompt="x", context=[], stream=False).done


def test_model_without_fim_tokens_keeps_ollamas_400(proxy):
    r = httpx.post(proxy.url + "/api/generate", json={"model": SERVED, "prompt": "a", "suffix": "b"}, timeout=10)
    assert r.status_code == 400 and r.json() == {"error": f'"{SERVED}" does not support insert'}
    assert "insert" not in httpx.post(proxy.url + "/api/show", json={"model": SERVED}, timeout=10).json()["capabilities"]


@pytest.mark.parametrize(
    ("root", "tokens", "style"),
    [
        # a library row decides for its repo: Qwen2.5-Coder fills in the middle...
        ("Qwen/Qwen2.5-Coder-7B-Instruct", QWEN_FIM, "qwen"),
        # ...Qwen2.5-Instruct has the same tokens but no FIM in Ollama's library
        ("Qwen/Qwen2.5-7B-Instruct", QWEN_FIM, None),
        # the row says FIM, but these files lack the tokens
        ("Qwen/Qwen2.5-Coder-7B-Instruct", [], None),
        # no row: the tokenizer decides (codegemma's tokens are a superset of qwen's, tried first)
        ("/models/mine", QWEN_FIM, "qwen"),
        ("/models/mine", ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_separator|>"], "codegemma"),
        ("/models/mine", ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"], "starcoder"),
        ("/models/mine", ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], "deepseek"),
        ("/models/mine", ["<|fim_prefix|>", "<|fim_suffix|>"], None),
    ],
)
def test_which_models_fill_in_the_middle(tmp_path, root, tokens, style):
    d = add_tokens(write_model_dir(tmp_path / "m"), tokens)
    files = read_model_files(str(d), "m")
    fmt = fim_format(root, files, library.load())
    assert (fmt.style if fmt else None) == style


def test_codellama_tokens_in_the_sentencepiece_vocabulary(tmp_path):
    d = write_model_dir(tmp_path / "m")
    vocab = {"▁<PRE>": 32007, "▁<SUF>": 32008, "▁<MID>": 32009, "▁<EOT>": 32010, "hello": 5}
    (d / "tokenizer.json").write_text(json.dumps({"added_tokens": [], "model": {"type": "BPE", "vocab": vocab}}))
    fmt = fim_format("/x/codellama", read_model_files(str(d), "m"), library.load())
    assert fmt is not None and fmt.style == "codellama"
    assert fmt.prompt("def f(", "):") == "<PRE> def f( <SUF>): <MID>"
    assert fmt.stop_token_ids == (32010, 32007, 32008, 32009) and fmt.stop == ()


def test_library_rows_with_insert_name_a_format():
    lib = library.load()
    fim_rows = {n for n in lib.names if "insert" in lib.resolve(n).capabilities}
    assert fim_rows == {"qwen2.5-coder", "codellama", "deepseek-coder", "deepseek-coder-v2", "starcoder2", "codegemma", "codestral"}
    assert all(lib.resolve(n).fim in lib.fim for n in fim_rows)
    assert lib.fim["codestral"].prompt("a", "b") == "[SUFFIX]b[PREFIX]a"
