"""One chat turn of ``vllama run``: load the model behind a spinner that says what the server
reports (``/readyz``), then stream one answer to the terminal (``POST /api/chat``), thinking
dimmed, words wrapped, timings on ``--verbose``. The ``>>>`` session (``repl.py``) and the
one-shot ``vllama run M PROMPT`` (``commands.py``) both call these.
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import sys
import threading
import time
from typing import Any

from .api_client import ApiError, Client, ConnectError
from .formatting import DIM, RESET, Spinner, WordWrap, print_stats

#: What the spinner says while a model in this server state comes up (``/readyz``'s ``state``).
LOADING_VERBS = {"starting": "loading", "unloaded": "loading", "sleeping": "waking", "restarting": "restarting",
                 "unhealthy": "restarting", "ready": "loading"}


def load_state(client: Client, model: str) -> str | None:
    """The server's state of ``model`` from vllama's ``/readyz`` (``starting``, ``sleeping``, ...);
    None when the server does not say (Ollama has no ``/readyz``; a model not yet claimed)."""
    try:
        body = client.probe("/readyz")
    except (ConnectError, OSError, http.client.HTTPException):
        return None
    want = model.removesuffix(":latest").casefold()
    entries = body.get("models") or ([body] if "state" in body and "model" in body else [])
    for entry in entries:
        if str(entry.get("model", "")).removesuffix(":latest").casefold() == want:
            return entry.get("state")
    return None


def watch_loading(client: Client, model: str, spinner: Spinner, done: threading.Event) -> None:
    """Until ``done``: put the server's state of ``model`` into ``spinner``'s message, once a second
    (``loading qwen2.5:7b: vLLM starting``), as ``ollama run`` shows a spinner while it loads."""
    while not done.wait(1.0):
        state = load_state(client, model)
        if state is not None and not done.is_set():
            spinner.message = f"{LOADING_VERBS.get(state, 'loading')} {model}: vLLM {state}"


def preload(client: Client, args: argparse.Namespace) -> None:
    """Load the model (an empty prompt, as ``ollama run`` does) behind a spinner that says what the
    server reports and for how long; 503s with ``Retry-After`` (loading) are retried with backoff
    up to ``--load-timeout``.

    Raises:
        ApiError: any other error at once, a 503 without ``Retry-After`` included: the model
            failed to load, and no wait will change that (Ollama fails at once too).
    """
    body: dict[str, Any] = {"model": args.model, "prompt": ""}
    if args.keepalive is not None:
        body["keep_alive"] = args.keepalive
    deadline, delay = time.monotonic() + args.load_timeout, 0.25
    done = threading.Event()
    with Spinner(f"loading {args.model}", elapsed=True) as spinner:
        if spinner.drawing:
            watcher = Client(client.url, connect_timeout=2.0)
            threading.Thread(target=watch_loading, args=(watcher, args.model, spinner, done), daemon=True).start()
        try:
            while True:
                try:
                    client.json("POST", "/api/generate", body)
                    return
                except ApiError as e:
                    if e.status != 503 or e.retry_after is None:
                        raise
                    if time.monotonic() + delay > deadline:
                        raise ApiError(f"{e} (gave up after {args.load_timeout:g} s)", e.status) from None
                    time.sleep(max(delay, min(_seconds(e.retry_after), 5.0)))
                    delay = min(delay * 2, 5.0)
        finally:
            done.set()


def _seconds(retry_after: str) -> float:
    try:
        return float(retry_after)
    except ValueError:  # an HTTP date: not sent by vllama; back off as usual
        return 0.0


def chat_once(client: Client, args: argparse.Namespace, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Stream one answer to stdout; returns the assistant message. Ctrl-C propagates after the socket is closed."""
    body: dict[str, Any] = {"model": args.model, "messages": messages, "stream": True}
    for key, value in (("think", args.think), ("format", args.format), ("keep_alive", args.keepalive),
                       ("options", getattr(args, "options", None) or None)):
        if value is not None:
            body[key] = value
    show_thinking = bool(args.think) and not args.hidethinking
    tty = sys.stdout.isatty()
    out = sys.stdout
    wrap = WordWrap(out, shutil.get_terminal_size().columns - 5) if tty and getattr(args, "wordwrap", False) else None
    content: list[str] = []
    final: dict[str, Any] = {}
    thinking = False
    spinner = Spinner()
    with spinner, client.stream("/api/chat", body) as events:
        for event in events:
            spinner.stop()
            msg = event.get("message") or {}
            if msg.get("thinking") and show_thinking:
                if not thinking:
                    out.write((DIM if tty else "") + "Thinking...\n")
                    thinking = True
                out.write(msg["thinking"])
            if msg.get("content"):
                if thinking:
                    out.write("\n...done thinking.\n\n" + (RESET if tty else ""))
                    thinking = False
                (wrap or out).write(msg["content"])
                content.append(msg["content"])
            out.flush()
            if event.get("done"):
                final = event
    if wrap is not None:
        wrap.close()
    if thinking:
        out.write("\n...done thinking." + (RESET if tty else ""))
    answer = "".join(content)
    if not answer.endswith("\n"):
        out.write("\n")
    out.flush()
    if args.verbose:
        print_stats(final)
    return {"role": "assistant", "content": answer}
