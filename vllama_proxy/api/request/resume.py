"""A stream that outlives its vLLM: asked again as token ids, continued on the same client stream.

A stream vLLM breaks mid-answer is asked again of the vLLM that serves the model next, on ``/v1/completions``
with the prompt's token ids followed by the output's ids already sent (both from vLLM's ``return_token_ids``,
asked by ``finisher.py``, never re-tokenized), the same sampling parameters, ``max_tokens`` less what was sent,
the key's ``cache_salt`` and ``priority``; a chat with tools is asked again as a chat. Its chunks are shaped as
the route's and fed to the same translator. Invariants: the client's prompt and each output token are charged
once (``settler.py``), the resume's own prompt is vllama's cost (``metrics.py``); a stream waits at most
``--resume-timeout`` (:func:`resume_timeout`) on the model's status board, then ends with the error it broke
with; what is not resumed is logged with why (``resume_refused``). Routes, limits and measurements:
``docs/operations.md`` "What survives what". Source: vLLM 0.32 ``entrypoints/openai/*/protocol.py``.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

from vllama_proxy.errors import UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable, VllamaError
from vllama_proxy.logs import get_logger
from vllama_proxy.models.catalog import reported_context
from vllama_proxy.upstream import Upstream, encode_json, never_sent
from ..metrics import RESUME_PROMPT_TOKENS, RESUMED_STREAMS

log = get_logger("vllama.resume")

#: What a chat or completions body carries over to the resume's ``/v1/completions`` as it is.
_CARRIED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
            "spaces_between_special_tokens", "bad_words", "logit_bias", "allowed_token_ids", "priority", "cache_salt",
            "user", "vllm_xargs")
#: Fields whose request cannot be continued from its middle (a grammar begins again; a tool parser reads the stream).
_UNRESUMABLE = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "functions")
#: The end of a reasoning block as vLLM's ``<think>`` parsers (qwen3, deepseek_r1) read it.
_END_THINK = "</think>"
#: Without a model's measured start: the least a stream waits, and what an ``--upstream`` vLLM gets.
_FLOOR_S = 60.0
_UPSTREAM_S = 120.0


def resume_timeout(configured: float | None, board: Any) -> tuple[float, str]:
    """``(seconds, source)`` a broken stream waits for its model to serve again: ``--resume-timeout``; else
    three times the model's latest start until ready (``StatusBoard.start_seconds``, measured by its supervisor:
    a restart takes about as long as a start, and a loaded machine, ``tests/README.md``, two to three times
    that), at least 60 s; an ``--upstream`` vLLM (no board) 120 s."""
    if configured is not None:
        return configured, "--resume-timeout"
    if board is None:
        return _UPSTREAM_S, "an --upstream vLLM: no start measured"
    start = float(board.start_seconds or 0.0)
    return max(_FLOOR_S, 3 * start), f"3 x the model's latest start ({start:.1f} s), at least {_FLOOR_S:g} s"


def resumable(error: BaseException) -> bool:
    """Whether ``error`` broke a stream that another vLLM may continue: the connection refused, reset or closed,
    no byte within the idle-read timeout, or vLLM's own 5xx (an ``EngineDeadError`` streamed as an error event);
    never a client's 4xx."""
    if isinstance(error, UpstreamRejected):
        return error.status >= 500
    return isinstance(error, (UpstreamUnavailable, UpstreamTimeout))


#: The agents' routes, relayed to vLLM's own Anthropic Messages and Responses APIs: why they are not resumed.
_OWN_APIS = {"/v1/messages": "vLLM's Anthropic Messages API", "/v1/responses": "vLLM's Responses API"}


def refusal(path: str, body: dict[str, Any]) -> str | None:
    """Why a request to vLLM at ``path`` cannot be resumed (``None``: it can)."""
    if path in _OWN_APIS:
        return (f"{_OWN_APIS[path]} renders the conversation and parses the answer itself and returns no token ids: "
                "the stream cannot be continued as token ids")
    if path not in ("/v1/chat/completions", "/v1/completions"):
        return f"{path} is not resumed"
    if path == "/v1/completions" and (body.get("echo") or body.get("suffix")):
        return "echo or suffix: a continuation would echo or frame its prompt again"
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return f"n={n}: several choices are not resumed"
    if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
        return "a batch of prompts is not resumed"
    for field in _UNRESUMABLE:
        if body.get(field):
            return f"{field}: not resumed (continued from its middle it would begin again)"
    return None


class Resume:
    """One stream's resumption: the token ids relayed so far, and the requests that continue it.

    Args:
        path: the route's vLLM path (``/v1/chat/completions`` or ``/v1/completions``).
        body: vLLM's body as finished (``finisher.py``); its sampling fields are carried over.
        upstream: the model's vLLM (the same address serves the restarted one; a router's picks another node).
        board: the model's status board (``supervisor/status.py``; ``None``: an ``--upstream`` vLLM).
        worker: this process's index among the workers (its news bell on the board).
        timeout: seconds a broken stream waits (:func:`resume_timeout`).
        max_model_len: the model's context (for ``max_tokens`` when the body set none), ``None``: unknown.
        headers: what went upstream with the body (a router's session key).
        route: the client's route (the metrics' label).
        unstreamed: a non-streamed request: only ever asked again whole (nothing of it reached the client), so
            nothing that refuses a continuation (:func:`refusal`: ``n`` > 1, structured output...) refuses it, and
            what breaks the restarted vLLM too, or vLLM's refusal of it, is final (:meth:`reopen`).
    """

    __slots__ = ("path", "body", "upstream", "board", "worker", "timeout", "max_model_len", "headers", "route",
                 "prompt_ids", "ids", "times", "base", "chat", "reasoning", "stack", "why_not", "shaped", "seen", "blind",
                 "relayed", "strip", "head", "thinking", "tools", "said", "kept", "called", "reasoned", "native", "unstreamed",
                 "sending")

    def __init__(self, path: str, body: dict[str, Any], upstream: Upstream, board: Any, worker: int, timeout: float,
                 max_model_len: int | None, headers: Any, route: str, *, relayed: bool = False,
                 strip: bool = False, unstreamed: bool = False) -> None:
        self.path = path
        self.body = body
        self.upstream = upstream
        self.board = board
        self.worker = worker
        self.timeout = timeout
        self.max_model_len = max_model_len
        self.headers = headers
        self.route = route
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []  # the output's token ids relayed to the client, in order
        self.times = 0  # resumes so far
        self.base = 0  # output tokens relayed before the latest resume
        self.chat = path == "/v1/chat/completions"
        self.reasoning = False  # a resumed chat continues inside its reasoning (until </think>)
        self.stack = AsyncExitStack()  # the resumes' upstream responses, closed with the stream
        self.unstreamed = unstreamed
        self.sending = False  # a request of the resume's is in vLLM's hands now
        self.why_not = None if unstreamed else refusal(path, body)
        self.blind = False  # a chunk with text came without its token ids: what was sent is not known as ids
        self.seen = False  # a chunk of the answer arrived (without the prompt's ids it cannot be continued)
        self.shaped = False  # the chunks now come from a continuation on /v1/completions: shaped as the route's
        self.relayed = relayed  # the client's own /v1 stream: continued chunks keep its id, object, created, model
        self.strip = strip  # the token ids were asked by vllama, not the client: taken out of what it is sent
        self.head: dict[str, Any] = {}  # the first chunk's id, object, created and model
        self.thinking = False  # a relayed chat's latest delta was reasoning (its continuation stays reasoning)
        # a chat with tools is continued as a chat (vLLM's tool parser reads only a chat's own stream): from its text
        self.tools = self.chat and bool(body.get("tools"))
        self.said: list[str] = []  # with tools: the content relayed so far
        self.kept = 0  # with tools: output tokens whose text was relayed (a tool call's fragments are not)
        self.called = False  # with tools: a tool call's fragment came from vLLM
        self.reasoned = False  # with tools: reasoning came from vLLM
        self.native = False  # the continuation is a chat on the route's own path: only its usage and identity change

    def take(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``chunks`` of one upstream read, their token ids kept; once resumed, shaped as the route's chunks
        with the whole answer's usage. Called once per read."""
        ids = self.ids
        if chunks:
            self.seen = True
        for chunk in chunks:
            choices = chunk.get("choices")
            if self.prompt_ids is None:
                prompt = chunk.get("prompt_token_ids") or (choices and choices[0].get("prompt_token_ids"))
                if prompt:
                    self.prompt_ids = list(prompt)
            if choices:
                choice = choices[0]
                got = choice.get("token_ids")
                if got:
                    ids.extend(got)
                elif got is None and (choice.get("text") or choice.get("delta")):
                    delta = choice.get("delta") or {}
                    if choice.get("text") or delta.get("content") or delta.get("reasoning") \
                            or delta.get("reasoning_content") or delta.get("tool_calls"):
                        self.blind = True
            if self.tools and choices:
                self._told(choices[0])
            if self.relayed:
                self._relayed(chunk, choices)
        if not self.shaped:
            return chunks
        return [self._shaped(chunk) for chunk in chunks]

    def _told(self, choice: dict[str, Any]) -> None:
        """A chat with tools: what its chunk says (content relayed, a call's fragment, reasoning)."""
        delta = choice.get("delta") or {}
        if delta.get("tool_calls"):
            self.called = True
        if delta.get("reasoning") or delta.get("reasoning_content"):
            self.reasoned = True
        if delta.get("content"):
            self.said.append(delta["content"])
            self.kept += len(choice.get("token_ids") or ())

    def _relayed(self, chunk: dict[str, Any], choices: Any) -> None:
        """A relayed stream's chunk: its first one's identity kept, whether a chat is in its reasoning, the token
        ids vllama asked for taken out (in place)."""
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        if choices and not self.shaped and self.chat:
            delta = choices[0].get("delta") or {}
            if delta.get("content"):
                self.thinking = False
            elif delta.get("reasoning") or delta.get("reasoning_content"):
                self.thinking = True
        if self.strip:
            chunk.pop("prompt_token_ids", None)
            for choice in choices or ():
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)

    def _shaped(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A resumed ``/v1/completions`` chunk as the original route's: its usage counting the client's prompt and
        the whole answer; for a chat, its text as a ``delta`` (reasoning until ``</think>``) and its logprobs in
        the chat's shape."""
        usage = chunk.get("usage")
        if usage:
            usage = {**usage, "prompt_tokens": len(self.prompt_ids or ()),
                     "completion_tokens": self.base + int(usage.get("completion_tokens") or 0)}
            chunk = {**chunk, "usage": usage}
        if self.relayed:  # the client's stream keeps its own id, object, created and model
            chunk = {**chunk, **self.head}
        if self.native or not self.chat or not chunk.get("choices"):
            return chunk
        choice = chunk["choices"][0]
        text = choice.get("text") or ""
        delta: dict[str, Any] = {}
        if self.reasoning and text:
            thought, end, said = text.partition(_END_THINK)
            if thought:
                delta["reasoning"] = thought
            if end:
                self.reasoning = False
                if said:
                    delta["content"] = said
        elif text:
            delta["content"] = text
        shaped: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}
        lp = choice.get("logprobs")
        if lp and lp.get("tokens"):
            tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
            shaped["logprobs"] = {"content": [
                {"token": tok, "logprob": val, "top_logprobs": [{"token": k, "logprob": v} for k, v in (top or {}).items()]}
                for tok, val, top in zip(lp["tokens"], lp.get("token_logprobs") or [], tops)]}
        return {**chunk, "choices": [shaped]}

    def can(self, error: BaseException, *, before_answer: bool = False, calls_sent: bool | None = None) -> bool:
        """Whether the stream broken by ``error`` is resumed (else the log says why, once); ``before_answer``: vLLM
        failed before its answer began, asked again only of a vLLM vllama runs (a router retries on its own).
        ``calls_sent``: with tools, whether a tool call (or a fragment of one) reached the client (default: any
        fragment came from vLLM, as a relayed stream passes them on; ``/api/chat`` sends only whole calls and says
        whether one was sent)."""
        if not resumable(error) or (before_answer and self.board is None):
            return False
        why = self.why_not or (None if self.prompt_ids or not self.seen else "vLLM sent no prompt token ids before it broke")
        if why is None and self.tools:
            why = self._tools_refusal(self.called if calls_sent is None else calls_sent)
        elif why is None and self.blind:
            why = "vLLM sent text without its token ids"
        if why is None and self.max_model_len and len(self.prompt_ids or ()) + len(self.ids) >= self.max_model_len:
            why = "the context is full"
        if why is not None:
            log.info("resume_refused", route=self.route, why=why, error=str(error)[:200])
            return False
        return True

    def _tools_refusal(self, calls_sent: bool) -> str | None:
        """Why a chat with tools cannot be continued from its text (``None``: it can)."""
        if calls_sent:
            return "tools: a tool call reached the client before the break (it would be sent again)"
        if self.reasoned:
            return "tools: reasoning was sent (a chat continued from its text renders no reasoning)"
        choice = self.body.get("tool_choice")
        if self.said and choice not in (None, "auto", "none"):
            return f"tools: tool_choice {choice!r} is a grammar that would begin again at the continuation"
        return None

    def _chat_continuation(self) -> dict[str, Any]:
        """The ``/v1/chat/completions`` body that continues a chat with tools: its messages and the content sent so
        far as the assistant's message to continue (vLLM's ``continue_final_message``, no generation prompt), so
        that vLLM's tool parser reads the rest, a tool call begun before the break written again from its start."""
        body = self.body
        out = {k: v for k, v in body.items() if k not in ("messages", "max_tokens", "max_completion_tokens", "min_tokens")}
        out.update(messages=[*body["messages"], {"role": "assistant", "content": "".join(self.said)}],
                   continue_final_message=True, add_generation_prompt=False, stream=True, return_token_ids=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": False})
        most = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(most, int):
            out["max_tokens"] = max(most - self.kept, 1)
        least = body.get("min_tokens")
        if isinstance(least, int) and least:
            out["min_tokens"] = max(least - self.kept, 0)
        return out

    def _continuation(self, in_reasoning: bool) -> dict[str, Any]:
        """The ``/v1/completions`` body that continues the stream."""
        body = self.body
        prompt = [*(self.prompt_ids or ()), *self.ids]
        out: dict[str, Any] = {"model": body["model"], "prompt": prompt, "stream": True, "return_token_ids": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
        for field in _CARRIED:
            if body.get(field) is not None:
                out[field] = body[field]
        most = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(most, int):
            out["max_tokens"] = max(most - len(self.ids), 1)
        elif self.max_model_len:
            out["max_tokens"] = max(self.max_model_len - len(prompt), 1)
        least = body.get("min_tokens")
        if isinstance(least, int) and least:
            out["min_tokens"] = max(least - len(self.ids), 0)
        if self.chat:
            if body.get("logprobs"):
                out["logprobs"] = int(body.get("top_logprobs") or 0)
        elif body.get("logprobs") is not None:
            out["logprobs"] = body["logprobs"]
        self.reasoning = in_reasoning
        return out

    async def reopen(self, error: VllamaError, in_reasoning: bool = False) -> Any:
        """The upstream response that continues the stream broken by ``error``, once the model serves again: the
        continuation on ``/v1/completions``, or, when nothing was relayed yet, the request itself asked again.

        Raises:
            VllamaError: ``error`` itself when the model did not serve again within the timeout, failed or
                stopped, or vLLM refused the continuation (its 4xx, logged).
        """
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        sent = self.kept if self.tools else len(self.ids)
        # nothing relayed (can() made sure), or a chat with tools that relayed no text: the same request, asked again
        whole = self.prompt_ids is None or (self.tools and not self.said)
        native = self.tools and not whole  # a chat with tools: continued as a chat, from its text
        path = self.path if whole or native else "/v1/completions"
        if not (whole or native or self.max_model_len or self.body.get("max_completion_tokens")
                or self.body.get("max_tokens")):
            await self._learn_context(error)  # vLLM's /v1/completions would stop the continuation at 16 tokens
        if whole:
            body = encode_json(self.body)
        else:
            body = encode_json(self._chat_continuation() if native else self._continuation(in_reasoning))
        restarts = self.board.restarts if self.board is not None else 0
        log.info("stream_broken", route=self.route, error=str(error)[:200], tokens_sent=sent,
                 resume_timeout_s=round(self.timeout, 1))
        pause = 0.05
        while True:
            if self.board is not None:
                await self._until_serving(error, deadline)
            restarted = self.board is not None and self.board.restarts > restarts and self.board.ready
            self.sending = True  # until vLLM answers or fails it (a client leaving meanwhile leaves it set)
            try:
                resp = await self.stack.enter_async_context(
                    self.upstream.request("POST", path, body=body, headers=self.headers))
                break
            except UpstreamRejected as e:
                self.sending = False
                # a 5xx of the vLLM that broke (its engine dead, not yet restarted) is waited out; one of the vLLM
                # started since, one of a vLLM that serves (its /health: where vllama runs it, or for a request
                # asked whole), or any 4xx, is its answer to the continuation: final (a non-streamed request's
                # client gets it as vLLM wrote it)
                if e.status < 500 or restarted or (
                        (self.board is not None or self.unstreamed) and await self.its_own(e)):
                    log.warning("resume_refused", route=self.route, why=f"vLLM refused the continuation: {e.message}")
                    if self.unstreamed:
                        raise
                    raise error from e
            except (UpstreamUnavailable, UpstreamTimeout) as e:
                self.sending = False
                # a non-streamed answer's idle read is its length, not a death; one that breaks the restarted vLLM
                # too (or, for an --upstream vLLM whose restarts vllama cannot see, any that took the request) is not
                # asked a third time (a request that kills its engine would take it down for everyone)
                if self.unstreamed and (isinstance(e, UpstreamTimeout) or restarted
                                        or (self.board is None and not never_sent(e))):
                    log.warning("resume_refused", route=self.route, why=f"asked again, it broke again: {e}")
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("resume_gave_up", route=self.route, waited_s=round(time.monotonic() - t0, 1))
                raise error
            # the model's vLLM not serving yet: its supervisor's next news, or a growing pause for an --upstream one
            news = self.board.news(self.worker) if self.board is not None else None
            try:
                await asyncio.wait_for(news if news is not None else asyncio.sleep(pause), min(pause, remaining))
            except asyncio.TimeoutError:
                pass
            pause = min(pause * 2, 2.0)
        self.times += 1
        self.shaped = not whole
        self.native = native
        self.base = sent
        if whole and self.tools:  # a tool call's fragments, never relayed, are made again: not counted twice
            self.ids.clear()
        prompt = len(self.prompt_ids or ()) + sent if not whole else 0  # asked whole: vLLM's usage counts it
        RESUMED_STREAMS.labels(self.route).inc()
        RESUME_PROMPT_TOKENS.labels(self.route).inc(prompt)
        log.info("stream_resumed", route=self.route, paused_s=round(time.monotonic() - t0, 2), tokens_sent=sent,
                 resume_prompt_tokens=prompt, resumes=self.times)
        return resp

    async def asked_again(self, error: VllamaError) -> bool:
        """Whether vLLM's failure ``error`` before its answer began is asked again (:meth:`reopen`): resumable where
        vllama runs the vLLM (:meth:`can`), unless it is a 5xx of a vLLM that still serves (:meth:`its_own`)."""
        if not self.can(error, before_answer=True):
            return False
        return not (isinstance(error, UpstreamRejected) and await self.its_own(error))

    async def its_own(self, error: VllamaError) -> bool:
        """Whether the request itself, not a dead engine, failed with ``error``: its vLLM still answers ``/health``
        with 200 within 5 s (vLLM's fails once its engine is dead; a router's says only that the router is up).
        Logged (``resume_refused``) when so: the request is not asked again."""
        try:
            status, _ = await asyncio.wait_for(self.upstream.answer("GET", "/health", {}), 5)
        except (UpstreamError, asyncio.TimeoutError):
            return False
        if status != 200:
            return False
        log.info("resume_refused", route=self.route, why="vLLM still serves: the failure was the request's own",
                 error=str(error)[:200])
        return True

    async def _learn_context(self, error: VllamaError) -> None:
        """The model's context from its vLLM's ``/v1/models`` (a router's: any node's), when vllama did not know it
        (an ``--upstream`` model listed before its vLLM was ready); ``error`` raised when it cannot be learnt."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                data = await self.upstream.get_json("/v1/models")
                break
            except (UpstreamUnavailable, UpstreamTimeout, UpstreamRejected):
                if time.monotonic() >= deadline:
                    log.warning("resume_gave_up", route=self.route, waited_s=round(self.timeout, 1))
                    raise error from None
                await asyncio.sleep(0.5)  # no vLLM answers yet (the router has none, or only the dead one)
        self.max_model_len = reported_context(data, str(self.body.get("model")))
        if self.max_model_len is not None:
            return
        log.warning("resume_refused", route=self.route,
                    why="the model's context length is unknown (a continuation would stop at vLLM's 16 tokens)")
        raise error

    async def _until_serving(self, error: VllamaError, deadline: float) -> None:
        """Until the model's board says it serves (told by its supervisor's news); ``error`` raised when it failed
        or stops, or at ``deadline``."""
        board = self.board
        while not board.ready:
            news = board.news(self.worker)  # before the look: a status published from here on answers it
            state = board.state.value
            if state in ("failed", "stopping", "stopped"):
                log.warning("resume_refused", route=self.route, why=f"the model is {state}")
                raise error
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("resume_gave_up", route=self.route, state=state)
                raise error
            try:
                await asyncio.wait_for(news, remaining)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        """The resumes' upstream responses closed (or pooled once read to their end)."""
        await self.stack.aclose()
