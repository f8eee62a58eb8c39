"""``vllama launch TOOL``: start a coding agent already pointed at vllama (Ollama 0.15's ``ollama launch``).

Each tool is told the server's URL, the key and the model the way it reads them, for this run only
(nothing in the user's files is changed, unlike Ollama's, which edits OpenCode's config file):

- **claude** (Claude Code, Anthropic's ``/v1/messages``): ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_AUTH_TOKEN``
  (sent as ``Authorization: Bearer``; ``ANTHROPIC_API_KEY`` emptied so that a stored Anthropic key
  is not sent instead), ``ANTHROPIC_MODEL`` and every tier's model (``ANTHROPIC_DEFAULT_OPUS_MODEL``,
  ``..._SONNET_...``, ``..._HAIKU_...``, ``CLAUDE_CODE_SUBAGENT_MODEL``: Claude Code's background
  calls would otherwise name Anthropic models), and ``--model``. Source: ollama/ollama
  ``cmd/config/claude.go``; code.claude.com/docs/en/settings (environment variables).
- **codex** (``/v1/responses``): a model provider given with ``-c`` (``model_provider``, and
  ``model_providers.vllama.{name,base_url,wire_api,env_key}``: Codex's ``config.toml`` keys; its
  ``wire_api`` takes only ``responses`` now) and ``-m MODEL``; the key in ``VLLAMA_API_KEY``, which
  ``env_key`` names. Ollama's runs ``codex --oss``, which reaches only a local Ollama at port 11434.
  Source: ollama/ollama ``cmd/config/codex.go``; openai/codex ``docs/config.md`` (model_providers).
- **opencode** (``/v1/chat/completions``): the whole provider in ``OPENCODE_CONFIG_CONTENT`` (inline
  config, applied over the user's files: opencode.ai/docs/config), an ``@ai-sdk/openai-compatible``
  provider ``vllama`` with the model, and ``model`` = ``vllama/MODEL``. Source: ollama/ollama
  ``cmd/config/opencode.go`` (the same provider block, written to ``~/.config/opencode/opencode.json``).

The server is ``--host`` or ``OLLAMA_HOST``, the key ``OLLAMA_API_KEY`` (as every client command
reads them: ``api_client.py``), so a remote vllama with keys works as a local one. No model given:
the only model served is taken, or, on a terminal, one is asked for from ``/api/tags`` (those that
can call tools marked), else the command says to name one. ``--config`` prints what would be set,
as shell lines (the key as ``$OLLAMA_API_KEY``, never its value), and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field

import orjson

from .api_client import ApiError, Client

KEY_VARIABLE = "OLLAMA_API_KEY"
#: What a tool is given for a key when the server has none (Claude Code asks to log in without one).
NO_KEY = "vllama"


@dataclass(frozen=True)
class Launch:
    """What one run of a tool gets: its executable, arguments and the environment variables set."""

    binary: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    """A coding agent ``vllama launch`` knows: its name, executable and how to install it."""

    name: str
    title: str
    binary: str
    install: str

    def launch(self, base: str, key: str | None, model: str, extra: list[str]) -> Launch:
        """The run of this tool against vllama at ``base`` (no trailing ``/``) with ``model``."""
        if self.name == "claude":
            env = {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_AUTH_TOKEN": key or NO_KEY, "ANTHROPIC_API_KEY": "",
                   "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                   "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model}
            return Launch(self.binary, ["--model", model, *extra], env)
        if self.name == "codex":
            provider = {"name": "vllama", "base_url": f"{base}/v1", "wire_api": "responses"}
            if key:
                provider["env_key"] = "VLLAMA_API_KEY"
            argv = ["-c", 'model_provider="vllama"']
            argv += [arg for k, v in provider.items() for arg in ("-c", f'model_providers.vllama.{k}={orjson.dumps(v).decode()}')]
            return Launch(self.binary, [*argv, "-m", model, *extra], {"VLLAMA_API_KEY": key} if key else {})
        config = {"$schema": "https://opencode.ai/config.json", "model": f"vllama/{model}",
                  "provider": {"vllama": {"npm": "@ai-sdk/openai-compatible", "name": "vllama",
                                          "options": {"baseURL": f"{base}/v1", "apiKey": key or NO_KEY},
                                          "models": {model: {"name": model}}}}}
        return Launch(self.binary, list(extra), {"OPENCODE_CONFIG_CONTENT": orjson.dumps(config).decode()})


TOOLS = {t.name: t for t in (
    Tool("claude", "Claude Code", "claude", "npm install -g @anthropic-ai/claude-code (https://code.claude.com/docs/en/quickstart)"),
    Tool("codex", "Codex", "codex", "npm install -g @openai/codex"),
    Tool("opencode", "OpenCode", "opencode", "npm install -g opencode-ai (https://opencode.ai)"),
)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``vllama launch``'s arguments (its subparser is made in ``main.py``)."""
    p.add_argument("tool", choices=sorted(TOOLS), help="the coding agent: " + ", ".join(f"{t.name} ({t.title})" for t in TOOLS.values()))
    p.add_argument("--model", help="the model it uses (default: the only one served, or asked for on a terminal)")
    p.add_argument("--config", action="store_true", help="print what would be set, start nothing")
    p.set_defaults(args=[])  # what follows ``--``, passed to the tool: split off by :func:`split_extra`


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """``vllama launch`` 's own arguments and the tool's (everything after the first ``--``)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def cmd_launch(client: Client, args: argparse.Namespace) -> int:
    """Start ``args.tool`` pointed at ``client``'s server (``os.execvpe``: the tool takes over this process)."""
    tool = TOOLS[args.tool]
    extra = list(args.args)
    path = shutil.which(tool.binary)
    if path is None and not args.config:
        print(f"Error: {tool.binary} is not installed; install it with: {tool.install}", file=sys.stderr)
        return 1
    model = args.model or choose_model(client)
    if model is None:
        return 1
    client.json("POST", "/api/show", {"model": model})  # 404 "model 'X' not found" before the tool starts
    key = os.environ.get(KEY_VARIABLE) or None
    run = tool.launch(client.url.rstrip("/"), key, model, extra)
    if args.config:
        print(config_text(run, key))
        return 0
    assert path is not None
    os.execve(path, [tool.binary, *run.argv], {**os.environ, **run.env})
    return 0  # not reached


def config_text(run: Launch, key: str | None) -> str:
    """``run`` as shell lines: one ``export`` per variable, then the command (the key as ``$OLLAMA_API_KEY``)."""
    def shown(text: str) -> str:
        quoted = shlex.quote(text)
        if key and key in text:  # the secret stays in the variable it came from
            quoted = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace(key, f"${KEY_VARIABLE}") + '"'
        return quoted
    lines = [f"export {k}={shown(v)}" for k, v in run.env.items()]
    return "\n".join([*lines, " ".join([run.binary, *(shown(a) for a in run.argv)])])


def choose_model(client: Client) -> str | None:
    """The model to launch with when none was named: the only one served, else one asked for on a
    terminal (tool-capable ones first and marked), else ``None`` after a line saying to name one."""
    names = [m.get("name") or m.get("model") for m in client.json("GET", "/api/tags").get("models") or []]
    names = [n for n in names if n]
    if len(names) == 1:
        return names[0]
    if not names:
        print("Error: the server serves no model yet; pull or serve one first", file=sys.stderr)
        return None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print(f"Error: name the model with --model (the server has: {', '.join(names)})", file=sys.stderr)
        return None
    tools = {n for n in names if "tools" in (_capabilities(client, n))}
    ordered = sorted(names, key=lambda n: (n not in tools, n))
    for i, n in enumerate(ordered, 1):
        print(f"{i:>3}. {n}{'  (tools)' if n in tools else ''}")
    while True:
        try:
            answer = input("Select a model [1]: ").strip() or "1"
        except EOFError:
            return None
        if answer.isdigit() and 1 <= int(answer) <= len(ordered):
            return ordered[int(answer) - 1]
        if answer in names:
            return answer
        print(f"enter a number from 1 to {len(ordered)}, or a model's name")


def _capabilities(client: Client, name: str) -> list[str]:
    try:
        return list(client.json("POST", "/api/show", {"model": name}).get("capabilities") or [])
    except ApiError:
        return []
