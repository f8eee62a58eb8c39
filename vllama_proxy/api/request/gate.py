"""The gate: an inference request's body, read within its limits, parsed once into its route's typed
request and checked, before any of its key's limits counts it.

``admission.py`` calls :func:`gate` for every inference request. Invariant: what it leaves in the
request's :class:`~..call.Call` is all that a route, the finisher and the settler read of the body:
``call.typed`` (``api/ollama/types.py``'s model, a relayed route's ``bodies.Body``, or ``None`` for a
form and the admin's untyped relayed routes, whose JSON is still parsed here once, strictly) and
``call.asked`` (the model). What a ``user`` key may send is decided here once for every route: the
field allow-list (``user_fields.py``), ``--max-choices``, ``--max-inputs`` (``/api/embed`` is sent in
parts instead) and the Responses API's stateless use (no ``background``, no ``previous_response_id``:
neither is charged to anyone). A refusal is a 400 naming the field, in the route family's shape.
"""

from __future__ import annotations

import email.policy
from email.parser import BytesParser
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from vllama_proxy.errors import BadRequest, FormNotAccepted, TooManyChoices, TooManyInputs
from .call import Call
from ..ollama.types import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    check_depth,
    json_object,
    parse_body,
    validation_message,
)
from ..policy.user_fields import user_body
from .bodies import BODIES, Body, Responses, fields

#: The Ollama inference routes and their typed requests.
OLLAMA: dict[str, type[BaseModel]] = {
    "/api/chat": ChatRequest,
    "/api/generate": GenerateRequest,
    "/api/embed": EmbedRequest,
    "/api/embeddings": EmbeddingsRequest,
}
#: The relayed routes that take a ``multipart/form-data`` body (an audio file); on any other a form is a 415.
FORM_ROUTES = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
#: Routes whose requests are sent to vLLM in parts of ``--max-inputs`` rather than refused (``routes/embed.py``).
SPLIT = frozenset({"/api/embed"})


def gate(request: web.Request, call: Call, body: bytes, *, max_choices: int, max_inputs: int | None) -> None:
    """Parse ``body`` (the request's, read within its limits) into ``call.typed`` and check it for
    ``call.key``; ``call.asked`` is the model it names.

    Raises:
        MissingBody: an Ollama route's body is empty.
        BadRequest: the body does not parse as JSON (or as its route's object), nests too deeply, gives a
            field a type other than its one (``invalid n: must be an integer, not "8"``), gives a field of
            vLLM's own machinery from a user key, or asks the Responses API to keep state from a user key.
        FormNotAccepted: a form on a route that takes JSON (415).
        TooManyChoices: a user key's ``n`` x prompts over ``max_choices``.
        TooManyInputs: a user key's inputs over ``max_inputs`` (but ``/api/embed``'s, sent in parts).
    """
    path = request.path
    call.body = body
    admin = call.key.admin
    ollama = OLLAMA.get(path)
    if ollama is not None:
        typed = parse_body(body, ollama)
        call.typed, call.asked = typed, typed.model
        if max_inputs is not None and not admin and path not in SPLIT and isinstance(typed, EmbedRequest):
            _check_inputs(len(typed.input or []) if isinstance(typed.input, list) else 1, max_inputs)
        return
    if request.content_type == "multipart/form-data":
        if path not in FORM_ROUTES:  # an allow-list: a form elsewhere would pass every check of the JSON body unread
            raise FormNotAccepted(f"{path} takes a JSON body, not multipart/form-data")
        call.asked = _form_model(request.headers.get("Content-Type", ""), body) if body else None
        return
    kind = BODIES.get(path)
    if kind is None:  # an admin's relayed route (adapters, render, ...): parsed strictly, forwarded as written again
        if body:
            data = _json(body)
            if isinstance(data, dict):
                call.typed = data
                model = data.get("model")
                call.asked = model if isinstance(model, str) else None
        return
    data = json_object(body) if body.strip() else {}
    try:
        typed = kind.model_validate(data)
    except ValidationError as e:
        raise BadRequest(_message(e), param=_field(e)) from None
    if not admin:
        extra = typed.__pydantic_extra__
        if extra:
            user_body(path, extra)  # the allow-list: vLLM's own machinery refused, fields it does not know dropped
        _check_user(path, typed, max_choices, max_inputs)
    call.typed, call.asked = typed, typed.model


def _check_user(path: str, typed: Body, max_choices: int, max_inputs: int | None) -> None:
    """A user key's bounds on what one request may ask of vLLM."""
    sequences = typed.sequences()
    if sequences > max_choices:
        n = getattr(typed, "n", None) or 1
        raise TooManyChoices(f"this request asks for {sequences} sequences at once (n {n} x {sequences // max(n, 1)} "
                             f"prompts); a key of role user may ask for at most {max_choices} (--max-choices): send "
                             "several requests")
    if max_inputs is not None:
        _check_inputs(typed.inputs(), max_inputs)
    if isinstance(typed, Responses):
        if typed.background:
            raise BadRequest("invalid background: vllama serves /v1/responses in the foreground only (a background "
                             "response runs on with no one to answer for it)", param="background")
        if typed.previous_response_id is not None:
            raise BadRequest("invalid previous_response_id: vllama serves /v1/responses stateless, as Ollama does; send "
                             "the conversation as input", param="previous_response_id")


def _check_inputs(inputs: int, most: int) -> None:
    if inputs > most:
        raise TooManyInputs(f"this request asks vLLM to encode {inputs} inputs at once; a key of role user may send at "
                            f"most {most} a request (--max-inputs): send several requests")


def upstream_fields(call: Call) -> Any:
    """What the gate checked, as the body that goes upstream is built from it: a typed relayed body's
    :func:`bodies.fields` (a new dict), an untyped route's parsed JSON, ``None`` for a form or no body."""
    typed = call.typed
    return fields(typed) if isinstance(typed, Body) else typed


def _json(body: bytes) -> Any:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON: {e}") from None
    if isinstance(data, (dict, list)):
        check_depth(data)
    return data


def _message(e: ValidationError) -> str:
    """The refusal's words: a list over its bound says so (a union's first error would only say its type)."""
    for err in e.errors(include_url=False):
        if err["type"] == "too_long":
            field = err["loc"][0]
            return (f"invalid {field}: at most {err['ctx'].get('max_length')} entries, not "
                    f"{err['ctx'].get('actual_length')}")
    return validation_message(e)


def _field(e: ValidationError) -> str | None:
    loc = e.errors(include_url=False)[0]["loc"]
    return str(loc[0]) if loc else None


def _form_model(content_type: str, body: bytes) -> str | None:
    """The ``model`` field of a ``multipart/form-data`` body (stdlib ``email`` parser), if any.

    Raises:
        BadRequest: the body gives ``model`` more than once (which one vLLM reads is its
            parser's choice, not the one checked here)."""
    message = BytesParser(policy=email.policy.HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        return None
    found = [part for part in message.iter_parts() if part.get_param("name", header="content-disposition") == "model"]
    if len(found) > 1:
        raise BadRequest("the form gives `model` more than once", param="model")
    if not found:
        return None
    value = found[0].get_payload(decode=True)
    return value.decode("utf-8", "replace").strip() if isinstance(value, bytes) else None
