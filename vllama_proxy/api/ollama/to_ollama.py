"""vLLM's answer -> Ollama's: pure translators of OpenAI/vLLM chunks into Ollama chunks, one
small state machine per response. No I/O here.

A :class:`Translator` is fed each decoded SSE chunk of one response and returns the Ollama chunks to
emit; :meth:`Translator.final` builds the one ``done: true`` record with vLLM's counts and nanosecond
durations (:class:`~vllama_proxy.api.ollama.timestamps.Timings`). Tool calls (fragments assembled into
whole calls) and logprobs are shaped here; a non-streamed answer is read as one chunk
(:func:`response_chunk`, :func:`unstreamed_timings`). ``api/request/relay.py`` drives it. Invariant:
per-chunk work is a dict lookup or two, the hot path (``benchmarks/token_cpu.py`` measures it).
Source: ``docs/wire.md`` "Responses" (one final chunk, durations in ns, non-zero when counts are);
Ollama's ``openai/openai.go``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from .timestamps import CLOCK, Timings

_FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop", "function_call": "stop"}


class Translator:
    """Turns one upstream stream into Ollama chunks; subclasses know generate vs chat.

    Args:
        model: the model name as the client sent it (echoed in every chunk).
        timings: marks shared with ``api/request/relay.py``'s ``relay``.
        aggregate: keep text and tool calls for a non-streaming answer.
    """

    def __init__(self, model: str, timings: Timings, *, aggregate: bool) -> None:
        self.model = model
        self.t = timings
        self.aggregate = aggregate
        self.done_reason = "stop"
        self.finished = False
        self.prompt_eval_count = 0
        self.eval_count = 0
        self.n_chunks = 0
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self._reasoned = False  # a reasoning delta arrived: the content's leading whitespace is eaten
        self._thought = False  # non-blank thinking was emitted
        self._said = False  # non-blank content was emitted after reasoning

    # subclasses: feed(chunk) -> list of Ollama chunk dicts; final() -> dict

    def _eat_whitespace(self, text: str | None, thinking: str | None) -> tuple[str | None, str | None]:
        """Whitespace right after ``<think>`` and right after ``</think>`` is dropped, as Ollama's
        thinking parser does (``thinking/parser.go``): vLLM's reasoning parsers pass on the model's
        ``"\n"`` after ``<think>`` and ``"\n\n"`` after ``</think>`` (seen with qwen3 on vLLM 0.26), which Ollama clients would show as blank lines."""
        if thinking:
            self._reasoned = True
            if not self._thought:
                thinking = thinking.lstrip()
                self._thought = bool(thinking)
        if text and self._reasoned and not self._said:
            text = text.lstrip()
            self._said = bool(text)
        return text, thinking

    def _usage_and_finish(self, chunk: dict[str, Any], choice: dict[str, Any] | None) -> None:
        usage = chunk.get("usage")
        if usage:
            self.prompt_eval_count = usage.get("prompt_tokens") or 0
            self.eval_count = usage.get("completion_tokens") or 0
        if choice is not None:
            fr = choice.get("finish_reason")
            if fr is not None:
                self.finished = True
                self.done_reason = _FINISH.get(fr, "stop")
                if self.t.first:
                    # The finish chunk carries the last counted token (EOS, or the end of a
                    # tool call vLLM's parser held back): eval_duration and TPOT end here,
                    # as vLLM's own TPOT, (latency - TTFT) / (output tokens - 1), does.
                    self.t.last = time.perf_counter_ns()

    def _keep(self, text: str | None, thinking: str | None, lps: list[dict[str, Any]] | None) -> None:
        """Collect a chunk's pieces for the aggregated (non-streaming) answer."""
        if text:
            self.content.append(text)
        if thinking:
            self.thinking.append(thinking)
        if lps:
            self.logprobs.extend(lps)

    def _mark_token(self) -> None:
        now = time.perf_counter_ns()
        if not self.t.first:
            self.t.first = now
        self.t.last = now
        self.n_chunks += 1

    @property
    def in_reasoning(self) -> bool:
        """The answer is inside its reasoning: thinking came and no content after it yet."""
        return self._reasoned and not self._said

    @property
    def output_tokens(self) -> int:
        """The answer's output tokens: vLLM's ``usage.completion_tokens``, else the chunks that carried one."""
        return self.eval_count or self.n_chunks

    def _final_fields(self) -> dict[str, Any]:
        t = self.t
        end = time.perf_counter_ns()
        eval_count = self.output_tokens
        first = t.first or end
        last = t.last or end
        return {
            "done": True,
            "done_reason": self.done_reason,
            "total_duration": max(end - t.received, 1),
            "load_duration": max(t.sent - t.received, 1),
            "prompt_eval_count": self.prompt_eval_count,
            "prompt_eval_duration": max(first - t.sent, 1),
            "eval_count": eval_count,
            "eval_duration": max(last - first, 1),
        }


def _logprobs_chat(lp: dict[str, Any] | None) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` -> Ollama ``logprobs`` entries (same keys, minus ``bytes``)."""
    if not lp or not lp.get("content"):
        return []
    return [
        {
            "token": e.get("token"),
            "logprob": e.get("logprob"),
            "top_logprobs": [{"token": x.get("token"), "logprob": x.get("logprob")} for x in e.get("top_logprobs") or []],
        }
        for e in lp["content"]
    ]


def _logprobs_completion(lp: dict[str, Any] | None) -> list[dict[str, Any]]:
    """OpenAI completions ``logprobs`` (parallel lists) -> Ollama ``logprobs`` entries."""
    if not lp or not lp.get("tokens"):
        return []
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return [
        {
            "token": tok,
            "logprob": val,
            "top_logprobs": [{"token": k, "logprob": v} for k, v in (top or {}).items()],
        }
        for tok, val, top in zip(lp["tokens"], lp.get("token_logprobs") or [], tops)
    ]


class GenerateTranslator(Translator):
    """``/api/generate`` chunks ``{model, created_at, response, thinking?, done}`` from either
    ``/v1/completions`` (raw) or ``/v1/chat/completions`` (templated) chunks."""

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        choices = chunk.get("choices")
        choice = choices[0] if choices else None
        self._usage_and_finish(chunk, choice)
        if choice is None:
            return []
        delta = choice.get("delta")
        if delta is None:  # /v1/completions
            text = choice.get("text")
            thinking = None
            lps = _logprobs_completion(choice.get("logprobs")) if choice.get("logprobs") else None
        else:
            text = delta.get("content")
            thinking = delta.get("reasoning") or delta.get("reasoning_content")
            lps = _logprobs_chat(choice.get("logprobs")) if choice.get("logprobs") else None
            if thinking or (self._reasoned and not self._said):
                text, thinking = self._eat_whitespace(text, thinking)
        if not text and not thinking:
            return []
        self._mark_token()
        if self.aggregate:
            self._keep(text, thinking, lps)
            return []
        out: dict[str, Any] = {"model": self.model, "created_at": CLOCK.now(), "response": text or "", "done": False}
        if thinking:
            out["thinking"] = thinking
        if lps:
            out["logprobs"] = lps
        return [out]

    def final(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": CLOCK.now(), "response": "".join(self.content)}
        if self.thinking:
            out["thinking"] = "".join(self.thinking)
        if self.logprobs:
            out["logprobs"] = self.logprobs
        out.update(self._final_fields())
        return out


class ChatTranslator(Translator):
    """``/api/chat`` chunks ``{model, created_at, message: {role, content, thinking?, tool_calls?}, done}``.

    OpenAI streams a tool call as fragments (name first, then pieces of a JSON string
    of arguments, keyed by ``index``); Ollama sends each call whole, in one chunk, with
    ``arguments`` as an object. Fragments are assembled here and a call is emitted once
    the next call starts or the choice finishes.
    """

    def __init__(self, model: str, timings: Timings, *, aggregate: bool) -> None:
        super().__init__(model, timings, aggregate=aggregate)
        self._calls: dict[int, dict[str, Any]] = {}  # index -> {"id", "name", "args": [str]}
        self.tool_calls: list[dict[str, Any]] = []

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        choices = chunk.get("choices")
        choice = choices[0] if choices else None
        if choice is None:
            self._usage_and_finish(chunk, None)
            return []
        delta = choice.get("delta") or {}
        text = delta.get("content")
        thinking = delta.get("reasoning") or delta.get("reasoning_content")
        if thinking or (self._reasoned and not self._said):
            text, thinking = self._eat_whitespace(text, thinking)
        out: list[dict[str, Any]] = []
        tc_deltas = delta.get("tool_calls")
        if tc_deltas:
            self._mark_token()
            for d in tc_deltas:
                idx = d.get("index", 0)
                if idx not in self._calls:
                    # A new call begins: the earlier ones are complete.
                    out.extend(self._flush(before=idx))
                    self._calls[idx] = {"id": d.get("id"), "name": "", "args": []}
                call = self._calls[idx]
                fn = d.get("function") or {}
                if fn.get("name"):
                    call["name"] += fn["name"]
                if fn.get("arguments"):
                    call["args"].append(fn["arguments"])
                if d.get("id") and not call["id"]:
                    call["id"] = d["id"]
        self._usage_and_finish(chunk, choice)
        if text or thinking:
            self._mark_token()
            lps = _logprobs_chat(choice.get("logprobs")) if choice.get("logprobs") else None
            if self.aggregate:
                self._keep(text, thinking, lps)
            else:
                msg: dict[str, Any] = {"role": "assistant", "content": text or ""}
                if thinking:
                    msg["thinking"] = thinking
                item: dict[str, Any] = {"model": self.model, "created_at": CLOCK.now(), "message": msg, "done": False}
                if lps:
                    item["logprobs"] = lps
                out.append(item)
        if self.finished:
            out.extend(self._flush())
        return out

    def drop_partial_calls(self) -> None:
        """Forget the calls not yet sent whole (their stream broke: ``api/request/resume.py`` has them written
        again from their start)."""
        self._calls.clear()

    def _flush(self, before: int | None = None) -> list[dict[str, Any]]:
        """Complete the buffered calls (those with index < ``before``, or all)."""
        done = sorted(i for i in self._calls if before is None or i < before)
        out = []
        for i in done:
            call = self._calls.pop(i)
            tc = _ollama_tool_call(call, len(self.tool_calls))
            self.tool_calls.append(tc)
            if not self.aggregate:
                msg = {"role": "assistant", "content": "", "tool_calls": [tc]}
                out.append({"model": self.model, "created_at": CLOCK.now(), "message": msg, "done": False})
        return out

    def final(self) -> dict[str, Any]:
        self._flush()
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) if self.aggregate else ""}
        if self.aggregate:
            if self.thinking:
                msg["thinking"] = "".join(self.thinking)
            if self.tool_calls:
                msg["tool_calls"] = self.tool_calls
        out: dict[str, Any] = {"model": self.model, "created_at": CLOCK.now(), "message": msg}
        if self.aggregate and self.logprobs:
            out["logprobs"] = self.logprobs
        out.update(self._final_fields())
        return out


def _ollama_tool_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An assembled OpenAI call -> Ollama's ``{id, function: {index, name, arguments: {...}}}``.

    Arguments that are not a JSON object (a model's malformed output) are kept, not
    dropped: they go under ``arguments`` as ``{"__raw__": text}`` so the client sees them.
    """
    raw = "".join(call["args"])
    try:
        args = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        args = {"__raw__": raw}
    fn = {"index": index, "name": call["name"], "arguments": args}
    return {"id": call["id"] or f"call_{index}", "function": fn}


def response_chunk(data: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed ``/v1/completions`` or ``/v1/chat/completions`` answer as the one stream
    chunk that says the same, so the translators read both: a chat choice's ``message``
    becomes its ``delta`` (tool calls get their ``index``, as streamed fragments have);
    a completion choice (``text``) is already shaped like a chunk's. ``usage`` is kept."""
    choices = data.get("choices") or []
    if not choices or "message" not in choices[0]:
        return data
    choice = dict(choices[0])
    delta = dict(choice.pop("message") or {})
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
    choice["delta"] = delta
    return {**data, "choices": [choice, *choices[1:]]}


def unstreamed_timings(t: Timings, data: dict[str, Any], end: int) -> None:
    """Set ``t.first`` / ``t.last`` (ns) for an answer vLLM sent whole at ``end``.

    ``eval_duration`` (last - first) is vLLM's own ``metrics.generation_time_ms`` (its first to
    its last output token: vLLM 0.26 ``build_per_request_timing_metrics``, present with
    ``--enable-per-request-metrics``), so the output's rate is vLLM's measure;
    ``prompt_eval_duration`` (first - sent) is the rest of the wait vllama measured (vLLM's
    queue, tokenizing, prefill, and the answer's way back). Without the metrics the whole wait
    counts as ``eval_duration`` (an output rate that is never too high)."""
    gen = (data.get("metrics") or {}).get("generation_time_ms")
    t.last = end
    if isinstance(gen, (int, float)) and not isinstance(gen, bool) and gen >= 0:
        t.first = max(end - int(gen * 1_000_000), t.sent)
    else:
        t.first = t.sent
