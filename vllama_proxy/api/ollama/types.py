"""Ollama's request types: loose in (unknown fields accepted), exact types checked.

Mirrors ``api/types.go`` of ollama/ollama and ``_types.py`` of ollama-python
(``docs/wire.md`` "Generate and chat requests"). A field's ``None`` means
"not sent": Ollama uses pointers where unset differs from false (``stream``, ``think``).

Responses are not modelled here: the hot path builds them as plain dicts and
serialises them with orjson (see ``ollama/to_ollama.py`` and ``relay.py``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, TypeAdapter, ValidationError, field_validator
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only from Python 3.12

from vllama_proxy.errors import BadRequest, MissingBody
from vllama_proxy.models.keep_alive import parse_keep_alive

StrOrList = Union[str, list[str]]

#: Most entries of a request's ``stop`` (strings), ``stop_token_ids`` and ``bad_words`` (``/v1``). vLLM pays for
#: each on every token, in loops every request shares: its API server checks each stop string against the new
#: text (``check_stop_strings``), its scheduler looks a token up in the stop-token list, its sampler walks the
#: bad words, each step of the whole batch (the costs measured: ``docs/decisions.md``). vLLM 0.32 bounds them
#: itself, in its own words (checked on the CPU build): ``stop`` at ``VLLM_MAX_STOP_STRINGS`` (4 by default:
#: vllama launches it with this bound, ``supervisor/launch.py``, since Ollama's clients send more),
#: ``bad_words`` at 128 tokens, ``stop_token_ids`` to the vocabulary; an older vLLM may not. OpenAI's API
#: takes 4 stop strings.
MAX_STOPS = 64


def _few_stops(v: StrOrList | None) -> StrOrList | None:
    if isinstance(v, list) and len(v) > MAX_STOPS:
        raise ValueError(f"invalid options.stop: at most {MAX_STOPS} stop strings, not {len(v)}")
    return v


#: ``options.stop``: a string or a list of at most :data:`MAX_STOPS`.
Stops = Annotated[Union[StrOrList, None], AfterValidator(_few_stops)]


class _Loose(BaseModel):
    # Ollama accepts and ignores fields it does not know; so do we.
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Options(TypedDict, total=False):
    """Ollama ``options`` (runtime + sampling): a dict of the options sent, and only those (unknown
    keys kept). Defaults are Ollama's, applied by ``translate``.

    A ``TypedDict``, not a model: pydantic checks only the keys sent and builds no 36-field
    instance, and ``translate`` reads what was sent without dumping every field (pydantic's
    "Performance" docs, "Use TypedDict over nested models"; measured: ``docs/decisions.md``). A sent
    ``null`` is kept as ``None``: readers skip it as unset.

    Sampling keys map onto vLLM's sampling parameters; runner keys (``num_ctx``,
    ``num_gpu``, ``num_thread``, ...) have no per-request meaning in vLLM and are
    logged and ignored. ``ignore_eos`` and ``min_tokens`` are vLLM extras accepted
    here so benchmarks can pin output length through the Ollama API.
    """

    __pydantic_config__ = ConfigDict(extra="allow")  # as _Loose: Ollama ignores unknown options

    num_predict: int | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    typical_p: float | None
    seed: int | None
    stop: Stops
    repeat_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repeat_last_n: int | None
    num_ctx: int | None
    num_keep: int | None
    num_batch: int | None
    num_gpu: int | None
    main_gpu: int | None
    num_thread: int | None
    use_mmap: StrictBool | None
    use_mlock: StrictBool | None
    numa: StrictBool | None
    low_vram: StrictBool | None
    f16_kv: StrictBool | None
    vocab_only: StrictBool | None
    logits_all: StrictBool | None
    embedding_only: StrictBool | None
    mirostat: int | None
    mirostat_tau: float | None
    mirostat_eta: float | None
    tfs_z: float | None
    penalize_newline: StrictBool | None
    # vLLM extras (not in Ollama): let Ollama-API clients pin output length.
    ignore_eos: StrictBool | None
    min_tokens: int | None


#: :class:`Options` checked on their own (a created model's ``PARAMETER`` s, alone or under a request's), built once.
OPTIONS: TypeAdapter[Options] = TypeAdapter(Options)


Format = Union[Literal["", "json"], dict[str, Any]]
#: Ollama ``think``: a bool, or a level: low/medium/high (0.9, gpt-oss) and "max" (0.22); api/types.go ThinkValue.
Think = Union[StrictBool, Literal["low", "medium", "high", "max"]]


def _keep_alive_seconds(v: Any) -> float | None:
    """A request's ``keep_alive``, parsed once here (``models/keep_alive.py``), in seconds; ``None``: not given (or
    blank), the model's own applies. Negative: forever; 0: unload now."""
    try:
        return parse_keep_alive(v, default=None)
    except BadRequest as e:
        raise ValueError(e.message) from None


if TYPE_CHECKING:
    KeepAlive = float
else:  # accepted as Ollama's ``api.Duration`` is (seconds or a Go duration), held as seconds
    KeepAlive = Annotated[Union[str, float, int], AfterValidator(_keep_alive_seconds)]


class GenerateRequest(_Loose):
    """``POST /api/generate`` body."""

    model: str | None = None
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    stream: StrictBool | None = None
    raw: StrictBool | None = None
    format: Format | None = None
    keep_alive: KeepAlive | None = None
    images: list[str] | None = None
    options: Options | None = None
    think: Think | None = None
    truncate: StrictBool | None = None
    shift: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class ToolCallFunction(_Loose):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class ToolCall(_Loose):
    id: str | None = None
    function: ToolCallFunction


class Message(_Loose):
    """A chat message; ``images`` are bare base64 strings (no ``data:`` prefix)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class ChatRequest(_Loose):
    """``POST /api/chat`` body."""

    model: str | None = None
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    format: Format | None = None
    options: Options | None = None
    stream: StrictBool | None = None
    think: Think | None = None
    keep_alive: KeepAlive | None = None
    truncate: StrictBool | None = None
    shift: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class EmbedRequest(_Loose):
    """``POST /api/embed`` body; ``dimensions`` truncates then re-normalises."""

    model: str | None = None
    input: StrOrList | None = None
    truncate: StrictBool | None = None
    dimensions: int | None = Field(None, gt=0)
    keep_alive: KeepAlive | None = None
    options: Options | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _none_is_empty(cls, v: Any) -> Any:
        return [] if v is None else v


class EmbeddingsRequest(_Loose):
    """Legacy ``POST /api/embeddings`` body: one ``prompt``, one vector back."""

    model: str | None = None
    prompt: str | None = None
    keep_alive: KeepAlive | None = None
    options: Options | None = None


class ModelRef(_Loose):
    """Bodies that only name a model: ``/api/show``, ``/api/delete``, ``/api/pull`` (``model`` or legacy ``name``)."""

    model: str | None = None
    name: str | None = None
    verbose: StrictBool | None = None
    stream: StrictBool | None = None

    @property
    def ref(self) -> str | None:
        return self.model or self.name


class CopyRequest(_Loose):
    """``POST /api/copy`` body (both required; checked by the handler for Ollama's message)."""

    source: str | None = None
    destination: str | None = None


class CreateRequest(_Loose):
    """``POST /api/create`` body (Ollama ``api.CreateRequest``; ``from`` is a Python keyword: ``from_``).

    ``files`` and ``adapters`` map file names to ``sha256:<hex>`` digests of uploaded blobs
    (``/api/blobs``); ``modelfile`` is the legacy text form, read as the fields it sets.
    """

    model: str | None = None
    name: str | None = None
    from_: str | None = Field(None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: StrOrList | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[Message] | None = None
    stream: StrictBool | None = None
    quantize: str | None = None
    modelfile: str | None = None
    #: Ollama 0.33: ``draft_files`` (file name -> digest, as ``files``), ``requires``, ``renderer``, ``parser``;
    #: ``draft`` is vllama's: a draft named as a Modelfile's ``DRAFT`` names one (a server directory,
    #: a Hugging Face repo id, ``ngram``), which Ollama's client sends as uploaded ``draft_files``
    draft: str | None = None
    draft_files: dict[str, str] | None = None
    draft_quantize: str | None = None
    requires: str | None = None
    renderer: str | None = None
    parser: str | None = None


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object (Ollama's routes, and the agents' as vllama reads them).

    Raises:
        MissingBody: the body is empty.
        BadRequest: the body is not JSON, not an object, or nested deeper than :data:`MAX_DEPTH`.
    """
    if not raw or not raw.strip():
        raise MissingBody()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    check_depth(data)
    return data


#: Most levels of arrays and objects a request body may nest (a JSON schema: two a level). vLLM compiles a
#: schema (``format``, ``response_format``, ``structured_outputs``, a required tool's ``parameters``) with
#: xgrammar, whose time and memory grow about as the cube of its inline nesting (measured:
#: ``docs/decisions.md``), in vLLM's engine process, every tenant's. vLLM 0.32 refuses a schema
#: nested past 64 levels itself (checked on its CPU build; an older one may not), once the model is loaded:
#: 64 and the few levels a body puts around a schema (``tools[0].function.parameters``), so that no schema
#: vLLM takes is refused here.
MAX_DEPTH = 72


def check_depth(data: Any, limit: int = MAX_DEPTH) -> None:
    """Refuse ``data`` (a parsed body) nested more than ``limit`` levels deep; one pass over its arrays
    and objects, stopping at the first too deep.

    Raises:
        BadRequest: ``request body is nested too deeply (at most 72 levels)``."""
    level: list[Any] = [data]
    for _ in range(limit):
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, (dict, list))]
        if not level:
            return
    raise BadRequest(f"request body is nested too deeply (at most {limit} levels)")


def parse_body(raw: bytes, cls: type[BaseModel]) -> Any:
    """Decode a request body into ``cls``.

    Raises:
        MissingBody: the body is empty.
        BadRequest: the body is not JSON, not an object, or a field has the wrong type
            (message names the field, e.g. ``invalid options.temperature: ...``).
    """
    data = json_object(raw)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise BadRequest(validation_message(e)) from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


#: What a field allows, where its type alone would read badly (a union, a duration).
_ALLOWED = {
    "format": '"json" or a JSON schema object',
    "think": 'true, false, "low", "medium", "high" or "max"',
    "keep_alive": 'a duration such as "5m" or a number of seconds (negative: forever)',
    "stop": "a string or a list of strings",
    "input": "a string or a list of strings",
    "role": '"system", "user", "assistant" or "tool"',
    "arguments": "an object",
}
#: Pydantic error types -> what was expected, in words.
_KINDS = {
    "bool_type": "true or false", "bool_parsing": "true or false",
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "string_type": "a string", "list_type": "a list", "dict_type": "an object", "model_type": "an object",
    "model_attributes_type": "an object",
}
#: Union members and validator wrappers pydantic puts in an error's location.
_MEMBER = re.compile(r"^(?:str|int|float|bool|list\[.*|dict\[.*|literal\[.*|function-.*|union\[.*|json-or-python\[.*|nullable\[.*|lax-or-strict\[.*|[a-z_]+\[.*\])$")


def _path(loc: tuple) -> str:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _MEMBER.match(p):
            out += f".{p}" if out else p
    return out


def _shown(value: Any) -> str:
    # a scalar as JSON (cut at 40 characters); a list or object by its kind (it may be nested
    # thousands deep)
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    try:
        text = orjson.dumps(value).decode()
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def validation_message(e: ValidationError) -> str:
    """One line in Ollama's plain words naming the first offending field, what it must be, and
    what was sent: ``invalid stream: must be true or false, not "yes"``,
    ``invalid messages[0].role: must be "system", "user", "assistant" or "tool", not "wizard"``.

    The validation library's own wording (type tags, union members) never reaches the client.
    """
    errors = e.errors(include_url=False)
    err = errors[0]
    path = _path(err["loc"]) or "body"
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "missing":
        return f"invalid {path}: is required"
    if kind == "recursion_loop":
        return "request body is nested too deeply"
    field = next((p for p in reversed(err["loc"]) if isinstance(p, str) and not _MEMBER.match(p)), "")
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound = {"greater_than": "greater than", "greater_than_equal": "at least", "less_than": "less than",
                 "less_than_equal": "at most"}[kind]
        limit = next(iter(ctx.values()), "")
        return f"invalid {path}: must be {bound} {limit}, not {_shown(err.get('input'))}"
    if kind == "value_error":  # our own validators' messages are already plain
        text = str(ctx.get("error", err["msg"])).removeprefix("Value error, ")
        return text if text.startswith("invalid ") else f"invalid {path}: {text}"
    allowed = _ALLOWED.get(field) or _KINDS.get(kind)
    if allowed is None and kind == "literal_error":
        allowed = str(ctx.get("expected", "")).replace("'", '"')
    if allowed is None:
        allowed = "a valid value"
    return f"invalid {path}: must be {allowed}, not {_shown(err.get('input'))}"
