"""The error tree drawn in ``docs/api.md`` ("Every error and its status") is the tree of ``errors.py``'s classes.

A reader finds every error a client can see, its parent and its HTTP status in that drawing
(httpx ``_exceptions.py`` style), so a class added, moved or given another status without
the drawing following fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from vllama_proxy import errors

#: The page and the heading of the section whose fenced block draws the tree.
_PAGE, _HEADING = Path(__file__).resolve().parent.parent / "docs" / "api.md", "### Every error and its status"

#: ``├── Name   NNN ...`` (the status is absent where it is not the class's own: UpstreamRejected).
_LINE = re.compile(r"^[ │├└─]*(?P<name>[A-Z][A-Za-z]+)(?:\s+(?P<status>\d{3}))?(?:\s|$)")


def _drawn() -> dict[str, tuple[str | None, int | None]]:
    """name -> (parent name, status) as the page's fenced block draws them."""
    section = _PAGE.read_text().split(_HEADING + "\n", 1)[1]
    block = [ln for ln in section.split("```\n")[1].splitlines() if re.search(r"[A-Z]", ln)]
    out: dict[str, tuple[str | None, int | None]] = {}
    stack: list[tuple[int, str]] = []
    for line in block:
        m = _LINE.match(line)
        assert m, f"unreadable line of the tree: {line!r}"
        depth = line.index(m.group("name"))  # the column of the name: its depth in the tree
        while stack and stack[-1][0] >= depth:
            stack.pop()
        out[m.group("name")] = (stack[-1][1] if stack else None, int(m.group("status")) if m.group("status") else None)
        stack.append((depth, m.group("name")))
    return out


def _classes() -> dict[str, type[errors.VllamaError]]:
    return {n: c for n, c in vars(errors).items()
            if inspect.isclass(c) and issubclass(c, errors.VllamaError) and c.__module__ == errors.__name__}


def test_the_docs_draw_every_class_with_its_parent_and_status() -> None:
    drawn, classes = _drawn(), _classes()
    assert sorted(drawn) == sorted(classes), "classes of errors.py missing from (or only in) docs/api.md's tree"
    for name, cls in classes.items():
        parent, status = drawn[name]
        assert parent == (None if cls is errors.VllamaError else cls.__bases__[0].__name__), name
        if status is not None:
            assert status == cls.status, f"{name}: drawn {status}, class says {cls.status}"
        else:
            assert cls is errors.UpstreamRejected, f"{name}: no status drawn"


def test_statuses_come_from_the_class_alone() -> None:
    """A raise site cannot pick a status: the base takes none (only vLLM's is passed on)."""
    try:
        errors.VllamaError("x", status=400)  # type: ignore[call-arg]
    except TypeError:
        pass
    else:
        raise AssertionError("VllamaError still takes status=")
    assert errors.UpstreamRejected("too long", 400).status == 400
    assert errors.TooManyPulls("busy").headers == {"Retry-After": "30"}
    assert errors.error_response(errors.ModelLoading("loading")).headers["Retry-After"] == "1"


def test_a_stream_that_fails_after_it_began_ends_in_its_apis_event() -> None:
    """An SSE stream relayed on ``/v1`` (``routes/openai.py``) ends with OpenAI's error object as a ``data:`` event
    (vLLM's own way, read by the ``openai`` client), on ``/v1/messages`` with Anthropic's ``event: error``
    (the ``anthropic`` client raises on that event name); Ollama's NDJSON line stays ``{"error": "..."}``."""
    gone = errors.UpstreamUnavailable("vLLM closed the connection")
    assert errors.error_event(gone, errors.shape_of("/v1/chat/completions")) == (
        b'data: {"error":{"message":"vLLM closed the connection","type":"api_error","param":null,"code":503}}\n\n')
    assert errors.error_event(gone, errors.shape_of("/v1/messages")) == (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"vLLM closed the connection"}}\n\n')
    assert errors.error_line(gone) == b'{"error":"vLLM closed the connection"}\n'
    assert [errors.shape_of(p) for p in ("/api/chat", "/v1/models", "/v1/responses", "/v1/messages/count_tokens", "/vllm/metrics")] == [
        "ollama", "openai", "openai", "anthropic", "ollama"]
