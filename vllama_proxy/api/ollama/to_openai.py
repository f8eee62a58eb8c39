"""Ollama -> vLLM: pure translation of Ollama requests into vLLM's OpenAI request bodies. No I/O here.

The reverse is ``to_ollama.py``. Field names follow each side: Ollama's in (``num_predict``,
``repeat_penalty``), vLLM's out (``max_tokens``, ``repetition_penalty``). Sources: ``docs/wire.md``;
vLLM's "OpenAI-Compatible Server" docs (extra sampling parameters, ``chat_template_kwargs``,
``response_format``, ``stream_options``). Invariant: unset Ollama options stay unset upstream, so vLLM
applies the model's ``generation_config.json`` defaults (what a Modelfile's ``PARAMETER`` lines are).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from vllama_proxy.errors import BadRequest, UnsupportedCapability
from vllama_proxy.models.created import CreatedModel
from vllama_proxy.models.fim import FimFormat
from vllama_proxy.upstream import encode_json
from .types import OPTIONS, ChatRequest, GenerateRequest, Message, Options

#: Ollama option -> vLLM sampling parameter, for keys whose value passes unchanged.
_SAME_VALUE = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_tokens",
}
#: Options with meaning only inside Ollama's runner (or no vLLM counterpart): logged, ignored.
IGNORED_OPTIONS = frozenset(
    {
        "num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap",
        "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only",
        "mirostat", "mirostat_tau", "mirostat_eta", "tfs_z", "penalize_newline", "typical_p",
        "repeat_last_n",
    }
)
_STREAM_OPTIONS = {"include_usage": True}


def sampling_params(options: Options | None) -> tuple[dict[str, Any], list[str]]:
    """vLLM sampling fields for Ollama ``options``, and the option names that were ignored.

    - ``num_predict``: ≤0 or unset means no cap (Ollama: -1 infinite, -2 fill context;
      its runner also treats 0 as no limit): ``max_tokens`` is left out. vLLM's chat
      endpoint then generates up to the context's end; its ``/v1/completions`` would stop
      at 16 (null or absent alike), so the generate handler fills in the remaining context
      (``routes/generate.py``).
    - ``top_k`` ≤0 and ``seed`` -1 mean "off"/"random" in Ollama and are left out.
    - ``stop`` may be a string or a list.
    - An option sent as ``null`` is unset.

    Returns:
        ``(fields, ignored)``: the body fields, and sorted names of options that have no
        vLLM meaning (``num_ctx``, ``mirostat``, unknown keys...).
    """
    out: dict[str, Any] = {}
    if not options:
        return out, []
    ignored = []
    for key, value in options.items():  # the options sent only (Options is a TypedDict)
        if value is None:
            continue
        if key in _SAME_VALUE:
            out[_SAME_VALUE[key]] = value
        elif key == "num_predict":
            if value > 0:
                out["max_tokens"] = value
        elif key == "top_k":
            if value > 0:
                out["top_k"] = value
        elif key == "seed":
            if value >= 0:
                out["seed"] = value
        elif key == "stop":
            out["stop"] = [value] if isinstance(value, str) else value
        else:
            ignored.append(key)
    return out, sorted(ignored)


def response_format(fmt: Any) -> dict[str, Any] | None:
    """Ollama ``format`` -> vLLM ``response_format``: ``"json"`` -> json_object, a schema -> json_schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise BadRequest(f"invalid format: {fmt!r} (use \"json\" or a JSON schema object)")


#: Image formats a vision model's processor (PIL in vLLM) reads, by their leading bytes.
_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)
_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,", re.ASCII)


def image_mime(data: bytes) -> str | None:
    """The media type of an image file from its first bytes (PNG, JPEG, GIF, WebP, BMP), else ``None``."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for magic, mime in _IMAGE_MAGIC:
        if data.startswith(magic):
            return mime
    return None


def image_url(b64: str, where: str = "images[0]") -> dict[str, Any]:
    """An OpenAI ``image_url`` part holding a ``data:`` URL that vllama builds itself.

    Ollama's API carries images as base64 file contents (``api.ImageData``, a ``[]byte``
    that Go decodes as standard base64); so does vllama. The media type is read from the
    decoded bytes, never taken from the client: nothing but an image vllama recognises
    reaches vLLM, so a URL (``http://169.254.169.254/...``, ``file:///etc/passwd``) can
    never make vLLM fetch anything. A ``data:image/...;base64,`` prefix (what browsers
    and some clients send) is accepted and its payload checked the same way.

    Raises:
        BadRequest: empty, not standard base64, or not a PNG/JPEG/GIF/WebP/BMP image
            (the message names the field, ``where``).
    """
    if not isinstance(b64, str) or not b64:
        raise BadRequest(f"invalid {where}: empty image")
    payload = b64[m.end():] if (m := _DATA_URL.match(b64)) else b64
    if "\n" in payload or "\r" in payload:  # Go's decoder skips line breaks; so do we
        payload = payload.replace("\r", "").replace("\n", "")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        kind = "a URL" if "://" in b64[:16] else "not base64"
        raise BadRequest(f"invalid {where}: {kind}; images must be base64-encoded image files") from None
    mime = image_mime(data)
    if mime is None:
        raise BadRequest(f"invalid {where}: not an image (PNG, JPEG, GIF, WebP or BMP)")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{payload}"}}


def _content(text: str | None, images: list[str] | None, where: str) -> Any:
    if not images:
        return text or ""
    parts: list[dict[str, Any]] = [image_url(img, f"{where}images[{i}]") for i, img in enumerate(images)]
    if text:
        parts.append({"type": "text", "text": text})
    return parts


def messages_to_openai(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama chat messages -> OpenAI messages.

    - ``images`` become ``image_url`` content parts.
    - assistant ``tool_calls`` (arguments as an object) become OpenAI tool calls with
      JSON-string ``arguments`` and an ``id`` (kept if the client sent one, else made up).
    - ``tool`` messages get a ``tool_call_id``: the one sent, else the id of the latest
      unanswered call of the function named by ``tool_name``, else a made-up one; the
      function name rides along as ``name``.
    - assistant ``thinking`` of earlier turns is dropped, as Ollama's templates do.
    """
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (function name, id) of calls not yet answered
    n_calls = 0
    for i, m in enumerate(messages):
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": _content(m.content, m.images, f"messages[{i}].")}
            if m.tool_calls:
                calls = []
                for tc in m.tool_calls:
                    call_id = tc.id or f"call_{n_calls}"
                    n_calls += 1
                    pending.append((tc.function.name, call_id))
                    calls.append(
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": tc.function.name, "arguments": encode_json(tc.function.arguments).decode()},
                        }
                    )
                msg["tool_calls"] = calls
                if not m.content:
                    msg["content"] = None
            out.append(msg)
        elif m.role == "tool":
            call_id = m.tool_call_id
            name = m.tool_name
            if call_id is None:
                match = next((p for p in reversed(pending) if name is None or p[0] == name), None)
                if match is not None:
                    pending.remove(match)
                    name = name or match[0]
                    call_id = match[1]
                else:
                    call_id = f"call_{n_calls}"
                    n_calls += 1
            else:
                pending = [p for p in pending if p[1] != call_id]
            msg = {"role": "tool", "content": m.content or "", "tool_call_id": call_id}
            if name:
                msg["name"] = name
            out.append(msg)
        else:
            out.append({"role": m.role, "content": _content(m.content, m.images, f"messages[{i}].")})
    return out


def thinking_fields(think: Any) -> dict[str, Any]:
    """Ollama ``think`` -> vLLM's ``chat_template_kwargs.enable_thinking`` (+ ``reasoning_effort`` for levels).

    A level goes to vLLM's ``reasoning_effort`` as it is: vLLM hands it to the chat template (gpt-oss
    reads low/medium/high, DeepSeek V4 "max") and turns thinking on for templates that read
    ``enable_thinking`` (vLLM 0.32 ``ChatCompletionRequest``: none, minimal, low, medium, high, xhigh, max).
    """
    if think is None:
        return {}
    if isinstance(think, str):
        return {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": think}
    return {"chat_template_kwargs": {"enable_thinking": bool(think)}}


def check_capabilities(model: str, caps: list[str], *, tools: bool = False, think: Any = None, images: bool = False) -> None:
    """Ollama's capability checks before generation.

    Raises:
        UnsupportedCapability: ``"X" does not support tools|thinking|vision|completion``.
    """
    if "completion" not in caps:
        raise UnsupportedCapability(model, "generate")
    if tools and "tools" not in caps:
        raise UnsupportedCapability(model, "tools")
    if think not in (None, False) and "thinking" not in caps:
        raise UnsupportedCapability(model, "thinking")
    if images and "vision" not in caps:
        raise UnsupportedCapability(model, "vision")


def _common(served: str, options: Options | None, fmt: Any, logprobs: bool | None, top_logprobs: int | None, chat: bool,
            whole: bool) -> tuple[dict[str, Any], list[str]]:
    """What every body shares: streamed upstream with its usage (``whole``: one unstreamed answer, :func:`final_only`),
    the sampling options, the format, the logprobs asked."""
    params, ignored = sampling_params(options)
    stream: dict[str, Any] = {"stream": False} if whole else {"stream": True, "stream_options": _STREAM_OPTIONS}
    body: dict[str, Any] = {"model": served, **stream, **params}
    rf = response_format(fmt)
    if rf is not None:
        body["response_format"] = rf
    if logprobs or top_logprobs:
        if chat:
            body["logprobs"] = True
            if top_logprobs:
                body["top_logprobs"] = top_logprobs
        else:
            body["logprobs"] = top_logprobs or 0
    return body, ignored


def chat_body(req: ChatRequest, served: str, *, whole: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``/api/chat`` -> ``/v1/chat/completions`` body (streamed upstream, but ``whole``: asked for one answer,
    :func:`final_only`) and ignored options."""
    body, ignored = _common(served, req.options, req.format, req.logprobs, req.top_logprobs, chat=True, whole=whole)
    body["messages"] = messages_to_openai(req.messages or [])
    if req.tools:
        body["tools"] = req.tools
    body.update(thinking_fields(req.think))
    return body, ignored


def with_model_defaults(req: ChatRequest | GenerateRequest, made: CreatedModel | None) -> tuple[Any, list[dict[str, Any]]]:
    """A request to a model made with ``/api/create``, with that model's layers applied, and the
    messages to put before a templated generate's prompt.

    As Ollama: the request's ``options`` win over the model's ``PARAMETER`` defaults; the model's
    ``SYSTEM`` is used when the request brings no system prompt of its own; its ``MESSAGE``s come
    before the conversation (chat) or the prompt (generate without ``raw``). A raw generate gets
    the options only. ``made`` ``None``: ``(req, [])`` unchanged.
    """
    if made is None:
        return req, []
    merged = {**made.parameters, **{k: v for k, v in (req.options or {}).items() if v is not None}}
    update: dict[str, Any] = {"options": OPTIONS.validate_python(merged) if merged else req.options}
    before = [dict(m) for m in made.messages]
    if isinstance(req, ChatRequest):
        msgs = list(req.messages or [])
        pre = [Message.model_validate(m) for m in before]
        if made.system and not any(m.role == "system" for m in msgs):
            pre.insert(0, Message(role="system", content=made.system))
        update["messages"] = pre + msgs
        return req.model_copy(update=update), []
    if req.raw:
        return req.model_copy(update=update), []
    if not req.system and made.system:
        update["system"] = made.system
    return req.model_copy(update=update), before


def generate_body(req: GenerateRequest, served: str, before: list[dict[str, Any]] | None = None, *,
                  whole: bool = False) -> tuple[str, dict[str, Any], list[str]]:
    """``/api/generate`` -> ``(upstream path, body, ignored options)``.

    ``raw: true`` sends the prompt untouched to ``/v1/completions``. Otherwise the
    model's own chat template is applied by vLLM: ``system`` + ``prompt`` (+ ``images``)
    go to ``/v1/chat/completions`` as a system and a user message (Ollama applies its
    Modelfile TEMPLATE the same way); ``before`` (a created model's ``MESSAGE``s) between them.
    Streamed upstream, but ``whole``: asked for one answer (:func:`final_only`).

    Raises:
        BadRequest: ``raw`` combined with ``template``/``system``/``context`` (as Ollama),
            ``raw`` with ``images``, or a custom ``template`` (a Go template we cannot render).
    """
    if req.context:
        raise BadRequest(
            "context is not supported: vllama keeps no token context between requests (Ollama deprecated it); "
            "send the conversation as messages to /api/chat, or the whole prompt with raw: true"
        )
    if req.raw:
        if req.template or req.system or req.context:
            raise BadRequest("raw mode does not support template, system, or context")
        if req.images:
            raise BadRequest("raw mode does not support images: send them without raw to apply the model's template")
        body, ignored = _common(served, req.options, req.format, req.logprobs, req.top_logprobs, chat=False, whole=whole)
        body["prompt"] = req.prompt or ""
        return "/v1/completions", body, ignored
    if req.template:
        raise BadRequest(
            "custom templates are not supported: vllama applies the model's own chat template; "
            "render the prompt yourself and send it with raw: true"
        )
    body, ignored = _common(served, req.options, req.format, req.logprobs, req.top_logprobs, chat=True, whole=whole)
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    messages += before or []
    messages.append({"role": "user", "content": _content(req.prompt, req.images, "")})
    body["messages"] = messages
    body.update(thinking_fields(req.think))
    return "/v1/chat/completions", body, ignored


#: vLLM's flag that puts per-request timings (``metrics``) into its answers (vLLM 0.26's
#: ``--enable-per-request-metrics``; it needs vLLM's stats, which ``--disable-log-stats`` turns off).
PER_REQUEST_METRICS = "--enable-per-request-metrics"


def final_only(vllm_args: tuple[str, ...] | list[str]) -> bool:
    """Whether a non-streamed Ollama request may reach this vLLM unstreamed: only when vLLM runs
    with ``--enable-per-request-metrics``, so its answer carries the timings Ollama's
    ``prompt_eval_duration`` / ``eval_duration`` are made of (``to_ollama.unstreamed_timings``).
    Unstreamed, vLLM's API server sends one answer instead of an event per token (vLLM's
    ``RequestOutputKind.FINAL_ONLY``) and vllama parses one body instead of every event."""
    return PER_REQUEST_METRICS in vllm_args and "--disable-log-stats" not in vllm_args


def fim_body(req: GenerateRequest, served: str, fmt: FimFormat, *, whole: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``/api/generate`` with ``suffix`` -> a ``/v1/completions`` body holding the model's FIM prompt.

    As Ollama's templates render ``.Suffix``: ``prompt`` is what precedes the cursor, ``suffix``
    what follows; ``system`` is not part of a FIM prompt (Ollama's code templates leave it out).
    The format's stop tokens go as ``stop_token_ids`` (a special token never appears in the text
    vLLM matches ``stop`` strings against), the rest as ``stop`` beside the client's own. Streamed upstream,
    but ``whole``: asked for one answer (:func:`final_only`).

    Raises:
        BadRequest: ``suffix`` with ``raw`` (a raw prompt is never templated), ``images``, or ``template``.
    """
    if req.context:
        raise BadRequest("context is not supported with suffix: send the code before the cursor as prompt")
    if req.raw:
        raise BadRequest("raw mode does not support suffix: send the model's fill-in-the-middle prompt as the raw prompt, or drop raw")
    if req.images:
        raise BadRequest("suffix (fill-in-the-middle) does not take images")
    if req.template:
        raise BadRequest("custom templates are not supported: vllama builds the model's own fill-in-the-middle prompt from suffix")
    body, ignored = _common(served, req.options, req.format, req.logprobs, req.top_logprobs, chat=False, whole=whole)
    body["prompt"] = fmt.prompt(req.prompt or "", req.suffix or "")
    stop = [*body.get("stop", []), *(s for s in fmt.stop if s not in body.get("stop", []))]
    if stop:
        body["stop"] = stop
    if fmt.stop_token_ids:
        body["stop_token_ids"] = list(fmt.stop_token_ids)
    return body, ignored
