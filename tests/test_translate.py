"""Pure translation functions: Ollama request pieces -> vLLM request pieces."""

from __future__ import annotations

import base64

import pytest
from conftest import _png

from vllama_proxy.api.ollama.types import GenerateRequest, Options
from vllama_proxy.api.ollama.timestamps import Timings
from vllama_proxy.api.ollama.to_ollama import ChatTranslator
from vllama_proxy.api.ollama.to_openai import image_url, response_format, sampling_params
from vllama_proxy.errors import BadRequest
from vllama_proxy.models.keep_alive import parse_keep_alive


def test_sampling_params_names_and_ignored():
    fields, ignored = sampling_params(Options(num_predict=0, repeat_penalty=1.1, stop="x", num_ctx=4096, mirostat=2, typical_p=0.5, foo=1))
    assert fields == {"repetition_penalty": 1.1, "stop": ["x"]}  # num_predict 0: no cap, left out
    assert ignored == ["foo", "mirostat", "num_ctx", "typical_p"]


def test_options_are_the_keys_sent_only():
    """A request's options are what it sent, nothing more: pydantic checks those keys only and builds no
    33-field instance that translate then dumps again (issue 42.4: a lone request's cold validation and
    ``sampling_params``, ~24 and ~14 µs on the 2-core VM). A ``null`` is kept and read as unset."""
    req = GenerateRequest.model_validate({"model": "m", "options": {"num_predict": 2, "temperature": None, "foo": 1}})
    assert req.options == {"num_predict": 2, "temperature": None, "foo": 1}
    assert sampling_params(req.options) == ({"max_tokens": 2}, ["foo"])


def test_response_format():
    assert response_format("") is None and response_format(None) is None
    assert response_format("json") == {"type": "json_object"}
    with pytest.raises(BadRequest):
        response_format("yaml")


#: A real 1x1 JPEG (JFIF) and GIF.
JPEG = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb004300080606070605080707070909080a0c140d0c0b0b0c1912130f141d1a1f1e1d1a1c1c"
    "20242e2720222c231c1c2837292c30313434341f27393d38323c2e333432ffc0000b080001000101011100ffc4001f0000010501010101010100"
    "000000000000000102030405060708090a0bffc400b5100002010303020403050504040000017d01020300041105122131410613516107227114"
    "328191a1082342b1c11552d1f02433627282090a161718191a25262728292a3435363738393a434445464748494a535455565758595a63646566"
    "6768696a737475767778797a838485868788898a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7b8b9bac2c3c4c5c6c7c8c9cad2d3"
    "d4d5d6d7d8d9dae1e2e3e4e5e6e7e8e9eaf1f2f3f4f5f6f7f8f9faffda0008010100003f00fbd3ffd9")
GIF = base64.b64decode("R0lGODlhAQABAIAAAP///wAAACH5BAEAAAAALAAAAAABAAEAAAICRAEAOw==")


@pytest.mark.parametrize("data,mime", [(_png(), "image/png"), (JPEG, "image/jpeg"), (GIF, "image/gif"),
                                       (b"RIFF\x1a\x00\x00\x00WEBPVP8L\x0d\x00\x00\x00/\x00\x00\x00\x10\x07\x10\x11\x11\x88\x88\xfe\x07\x00", "image/webp")])
def test_real_images_become_data_urls_with_the_type_of_their_bytes(data, mime):
    b64 = base64.b64encode(data).decode()
    assert image_url(b64) == {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}
    # a data: URL from a browser is checked the same way, and the type comes from the bytes
    assert image_url(f"data:image/png;base64,{b64}")["image_url"]["url"] == f"data:{mime};base64,{b64}"
    # base64 wrapped at 76 columns (MIME style) is accepted, as Go's decoder does
    assert image_url(base64.encodebytes(data).decode())["image_url"]["url"] == f"data:{mime};base64,{b64}"


@pytest.mark.parametrize("value,message", [
    ("http://169.254.169.254/latest/meta-data/", "a URL"),
    ("https://example.com/cat.png", "a URL"),
    ("file:///etc/passwd", "a URL"),
    ("/etc/passwd", "not base64"),
    ("/etc/shadow/", "not an image"),  # valid base64 (12 characters), but decodes to no image
    ("!!!notbase64###", "not base64"),
    ("", "empty image"),
    ("iVBORw0", "not base64"),  # a truncated PNG header: bad padding
    (base64.b64encode(b"just some text, not a picture").decode(), "not an image"),
    ("data:text/html;base64," + base64.b64encode(b"<script>").decode(), "not base64"),
])
def test_anything_but_a_base64_image_is_400_naming_the_field(value, message):
    with pytest.raises(BadRequest) as e:
        image_url(value, "messages[2].images[1]")
    assert e.value.status == 400
    assert e.value.message.startswith("invalid messages[2].images[1]: ") and message in e.value.message


@pytest.mark.parametrize("value,seconds", [(None, 300), ("10m", 600), ("1h30m", 5400), ("-1m", -60), (0, 0), ("0", 0), ("1.5s", 1.5), ("", 300), (-1, -1)])
def test_keep_alive(value, seconds):
    assert parse_keep_alive(value, default=300) == seconds


def test_malformed_tool_arguments_are_kept():
    t = ChatTranslator("m", Timings(0), aggregate=True)
    t.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{oops"}}]}, "finish_reason": None}]})
    t.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    assert t.final()["message"]["tool_calls"] == [{"id": "c1", "function": {"index": 0, "name": "f", "arguments": {"__raw__": "{oops"}}}]


@pytest.mark.parametrize("value,seconds", [("10m", 600), ("0", 0), (-1, -1), ("", None), (None, None), (True, 1)])
def test_the_typed_request_holds_keep_alive_in_seconds(value, seconds):
    """keep_alive is parsed once, by the typed request (the gate's parse): the load/unload decision, the hold's
    expiry and the unload check read its seconds instead of parsing the string again, three times a request."""
    from vllama_proxy.api.ollama.types import ChatRequest, GenerateRequest

    for cls in (ChatRequest, GenerateRequest):
        assert cls.model_validate({"keep_alive": value}).keep_alive == seconds
