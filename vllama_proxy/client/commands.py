"""The client commands' handlers: each talks to a running server through the Ollama API
(``api_client.py``) and prints what Ollama's CLI prints (``formatting.py``).

  list [PREFIX] (GET /api/tags)      ps (GET /api/ps)            create NAME [-f F] (``create.py``)
  show M [--modelfile|...] (/api/show)   pull M (/api/pull, tqdm bars)   stop M (keep_alive 0)
  run M [PROMPT...] (/api/chat; ``repl.py`` on a terminal)   cp SRC DST (/api/copy)   rm M... (/api/delete)

Each handler takes the client and the parsed arguments (``main.py``) and returns the exit status;
errors propagate as :class:`~.api_client.ApiError` and :class:`~.api_client.ConnectError`, which
``main.py`` prints.
"""

from __future__ import annotations

import argparse
import http.client
import sys

from vllama_proxy import __version__

from .api_client import ApiError, Client, ConnectError
from .chat import chat_once, preload
from .formatting import PullProgress, list_table, ps_table, show_info
from .repl import interactive


def cmd_list(client: Client, args: argparse.Namespace) -> int:
    models = client.json("GET", "/api/tags").get("models") or []
    sys.stdout.write(list_table(models, args.prefix))
    return 0


def cmd_ps(client: Client, args: argparse.Namespace) -> int:
    models = client.json("GET", "/api/ps").get("models") or []
    sys.stdout.write(ps_table(models))
    return 0


def cmd_show(client: Client, args: argparse.Namespace) -> int:
    info = client.json("POST", "/api/show", {"model": args.model})
    for flag in ("modelfile", "template", "parameters", "license"):
        if getattr(args, flag):
            print(info.get(flag) or "")
            return 0
    print(show_info(info))
    return 0


def cmd_stop(client: Client, args: argparse.Namespace) -> int:
    """Ollama's ``stop``: unload with ``keep_alive: 0``; prints nothing, as Ollama's does."""
    client.json("POST", "/api/generate", {"model": args.model, "prompt": "", "keep_alive": 0})
    return 0


def print_version(host: str | None = None) -> int:
    """``vllama -v``, as ``ollama -v`` prints it: the server's version (at ``OLLAMA_HOST``), and the
    client's when it differs or no server answers (``/api/version``: ``{"version", "vllama"}``)."""
    try:
        info = Client(host, connect_timeout=2.0).json("GET", "/api/version")
    except (ConnectError, ApiError, OSError, http.client.HTTPException, ValueError):
        info = None
        print("Warning: could not connect to a running vllama instance")
    server = (info or {}).get("vllama")
    if server:
        print(f"vllama version is {server}")
    elif info:  # an Ollama server: it says only its own version
        print(f"ollama version is {info.get('version')}")
    if server != __version__:
        print(f"Warning: client version is {__version__}")
    return 0


def cmd_cp(client: Client, args: argparse.Namespace) -> int:
    """Ollama's ``cp SOURCE DESTINATION``: vllama keeps the new name as an alias."""
    client.json("POST", "/api/copy", {"source": args.source, "destination": args.destination})
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def cmd_rm(client: Client, args: argparse.Namespace) -> int:
    """Ollama's ``rm MODEL...``: an alias is forgotten, a cached Hugging Face model deleted."""
    for model in args.models:
        client.json("DELETE", "/api/delete", {"model": model})
        print(f"deleted '{model}'")
    return 0


def cmd_pull(client: Client, args: argparse.Namespace) -> int:
    progress = PullProgress()
    try:
        with client.stream("/api/pull", {"model": args.model, "insecure": args.insecure, "stream": True}) as events:
            for event in events:
                progress.update(event)
    finally:
        progress.close()
    return 0


def cmd_run(client: Client, args: argparse.Namespace) -> int:
    prompt = " ".join(args.prompt)
    piped = not sys.stdin.isatty()
    if piped:  # like ollama: stdin first, then the arguments
        prompt = " ".join(p for p in (sys.stdin.read(), prompt) if p)
    shown: dict = {}
    try:  # as `ollama run`: a model the server does not have is pulled first, with progress
        shown = client.json("POST", "/api/show", {"model": args.model}) or {}
    except ApiError as e:
        if e.status == 404:
            cmd_pull(client, argparse.Namespace(model=args.model, insecure=False))
        # anything else (a model still loading: 503) is preload's to wait for or report
    if getattr(args, "think", None) is None and "thinking" in (shown.get("capabilities") or []):
        args.think = True  # Ollama's inferThinkingOption (cmd/cmd.go): a thinking model thinks, shown unless --hidethinking
    preload(client, args)
    if not piped and not prompt:
        return interactive(client, args)
    if not prompt.strip():  # nothing piped in: the model is loaded, nothing to ask
        return 0
    chat_once(client, args, [{"role": "user", "content": prompt}])
    return 0
