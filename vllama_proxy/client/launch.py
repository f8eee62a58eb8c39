"""``vllama launch TOOL``: start a coding agent already pointed at vllama (Ollama 0.15's ``ollama launch``).

Each tool (claude, codex, opencode, copilot, qwen, kimi, pool, droid) is told the server's URL, the
key and the model the way it reads them: environment variables or inline configuration for this
run only, never the user's files (droid, configured only by its file, gets a ``customModels`` entry
in ``~/.factory/settings.json``: vllama's own earlier entries replaced, the rest kept). What each
tool is given and why: ``docs/agents.md``. Sources: ollama/ollama ``cmd/config/{claude,codex,
opencode}.go`` and ``cmd/launch/{copilot,qwen,kimi,poolside,droid}.go``; code.claude.com/docs/en/settings;
openai/codex ``docs/config.md``; opencode.ai/docs/config. The server and key are ``--host`` /
``OLLAMA_HOST`` and ``OLLAMA_API_KEY`` (``api_client.py``); ``--config`` prints the settings as
shell lines (the key as ``$OLLAMA_API_KEY``) and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .api_client import ApiError, Client

KEY_VARIABLE = "OLLAMA_API_KEY"
#: What a tool is given for a key when the server has none (Claude Code asks to log in without one).
NO_KEY = "vllama"


@dataclass(frozen=True)
class Launch:
    """What one run of a tool gets: its executable, arguments, the environment variables set, and the
    files written before it starts (path -> whole new content; only Droid has one)."""

    binary: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[Path, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    """A coding agent ``vllama launch`` knows: its name, executable and how to install it."""

    name: str
    title: str
    binary: str
    install: str

    def launch(self, base: str, key: str | None, model: str, extra: list[str], show: dict[str, Any] | None = None) -> Launch:
        """The run of this tool against vllama at ``base`` (no trailing ``/``) with ``model``; ``show`` is the
        model's ``/api/show`` answer (Kimi's context size, Droid's image support)."""
        show = show or {}
        if self.name == "copilot":
            env = {"COPILOT_PROVIDER_BASE_URL": f"{base}/v1", "COPILOT_PROVIDER_API_KEY": key or NO_KEY,
                   "COPILOT_PROVIDER_WIRE_API": "responses", "COPILOT_MODEL": model}
            return Launch(self.binary, ["--model", model, *extra], env)
        if self.name == "qwen":
            env = {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": key or NO_KEY, "OPENAI_MODEL": model}
            return Launch(self.binary, ["--auth-type", "openai", "--model", model, *extra], env)
        if self.name == "pool":
            return Launch(self.binary, ["-m", model, *extra], {"POOLSIDE_STANDALONE_BASE_URL": f"{base}/v1", "POOLSIDE_API_KEY": key or NO_KEY})
        if self.name == "kimi":
            config = {"default_model": "vllama",
                      "providers": {"vllama": {"type": "openai_legacy", "base_url": f"{base}/v1", "api_key": key or NO_KEY}},
                      "models": {"vllama": {"provider": "vllama", "model": model, "max_context_size": context_length(show)}}}
            return Launch(self.binary, ["--config", orjson.dumps(config).decode(), *extra])
        if self.name == "droid":
            path = droid_settings_path()
            return Launch(self.binary, list(extra), files={path: droid_settings(path, base, key, model, show)})
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
    Tool("copilot", "GitHub Copilot CLI", "copilot", "npm install -g @github/copilot (https://github.com/features/copilot/cli/)"),
    Tool("qwen", "Qwen Code", "qwen", "npm install -g @qwen-code/qwen-code (https://qwen.ai/qwencode)"),
    Tool("kimi", "Kimi Code CLI", "kimi", "uv tool install kimi-cli (https://moonshotai.github.io/kimi-cli/en/guides/getting-started.html)"),
    Tool("pool", "Poolside", "pool", "the instructions at https://github.com/poolsideai/pool"),
    Tool("droid", "Droid", "droid", "curl -fsSL https://app.factory.ai/cli | sh (https://docs.factory.ai/cli/getting-started/quickstart)"),
)}

#: What marks Droid's ``customModels`` entries that ``vllama launch droid`` wrote (replaced on the next launch).
DROID_MARK = " (vllama)"


def context_length(show: dict[str, Any]) -> int:
    """The model's context from its ``/api/show`` answer (``details.context_length``, else ``model_info``'s
    ``<arch>.context_length``); 32768 when it says none."""
    given = (show.get("details") or {}).get("context_length")
    if isinstance(given, int) and given > 0:
        return given
    for k, v in (show.get("model_info") or {}).items():
        if k.endswith(".context_length") and isinstance(v, int) and v > 0:
            return v
    return 32768


def droid_settings_path() -> Path:
    """``~/.factory/settings.json`` (Droid's settings; Ollama's ``cmd/launch/droid.go``)."""
    return Path.home() / ".factory" / "settings.json"


def droid_settings(path: Path, base: str, key: str | None, model: str, show: dict[str, Any]) -> str:
    """Droid's settings file with ``model`` on vllama as its session's default: the file's own keys and
    ``customModels`` kept, the entries an earlier ``vllama launch droid`` wrote replaced.

    Raises:
        SystemExit: the file is there and is not a JSON object (it is left as it is).
    """
    settings: dict[str, Any] = {}
    if path.exists():
        try:
            settings = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as e:
            raise SystemExit(f"Error: {path} is not valid JSON ({e}); fix or move it, then launch again") from None
        if not isinstance(settings, dict):
            raise SystemExit(f"Error: {path} is not a JSON object; fix or move it, then launch again")
    others = [m for m in settings.get("customModels") or []
              if not (isinstance(m, dict) and str(m.get("displayName", "")).endswith(DROID_MARK))]
    ident = f"custom:vllama-{model}"
    entry = {"model": model, "displayName": model + DROID_MARK, "baseUrl": f"{base}/v1", "apiKey": key or NO_KEY,
             "provider": "generic-chat-completion-api", "maxOutputTokens": min(64000, context_length(show)),
             "supportsImages": "vision" in (show.get("capabilities") or []), "id": ident, "index": 0}
    settings["customModels"] = [entry, *others]
    session = settings.get("sessionDefaultSettings")
    settings["sessionDefaultSettings"] = {**(session if isinstance(session, dict) else {}), "model": ident}
    return orjson.dumps(settings, option=orjson.OPT_INDENT_2).decode() + "\n"


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
    shown = client.json("POST", "/api/show", {"model": model})  # 404 "model 'X' not found" before the tool starts
    key = os.environ.get(KEY_VARIABLE) or None
    run = tool.launch(client.url.rstrip("/"), key, model, extra, shown if isinstance(shown, dict) else {})
    if args.config:
        print(config_text(run, key))
        return 0
    assert path is not None
    for file, text in run.files.items():
        write_settings(file, text)
    os.execve(path, [tool.binary, *run.argv], {**os.environ, **run.env})
    return 0  # not reached


def write_settings(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, the earlier file kept as ``<name>.vllama.bak``; said on stderr."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        shutil.copy2(path, path.with_name(path.name + ".vllama.bak"))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)  # it holds the key
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)


def config_text(run: Launch, key: str | None) -> str:
    """``run`` as shell lines: each file it would write as a comment and a heredoc, one ``export`` per
    variable, then the command (the key as ``$OLLAMA_API_KEY``)."""
    def shown(text: str) -> str:
        quoted = shlex.quote(text)
        if key and key in text:  # the secret stays in the variable it came from
            quoted = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace(key, f"${KEY_VARIABLE}") + '"'
        return quoted
    files = [f"cat > {shlex.quote(str(p))} <<EOF\n{t.replace(key, '$' + KEY_VARIABLE) if key else t}EOF" for p, t in run.files.items()]
    lines = [f"export {k}={shown(v)}" for k, v in run.env.items()]
    return "\n".join([*files, *lines, " ".join([run.binary, *(shown(a) for a in run.argv)])])


def choose_model(client: Client) -> str | None:
    """The model to launch with when none was named: the only one served, else one asked for on a
    terminal (tool-capable ones first and marked), else ``None`` after a line saying to name one. Names with one
    digest (a model and its aliases: ``vllama cp``, ``--alias``) are one model, named as listed first (its served
    name); a created model (``vllama create``) has a digest of its own and is a model of its own."""
    listed = [m for m in client.json("GET", "/api/tags").get("models") or [] if m.get("name") or m.get("model")]
    same: dict[str, list[str]] = {}  # digest -> its names, in the listed order
    for m in listed:
        name = m.get("name") or m.get("model")
        same.setdefault(m.get("digest") or f"name:{name}", []).append(name)
    names = [ns[0] for ns in same.values()]
    aliases = {ns[0]: ns[1:] for ns in same.values()}
    # Ollama 0.33's tags say each model's capabilities (as Ollama's launch reads them: cmd/launch/model_inventory.go);
    # an older server's do not: then /api/show is asked, per model
    said = {m.get("name") or m.get("model"): m["capabilities"] for m in listed if isinstance(m.get("capabilities"), list)}
    if len(names) == 1:
        return names[0]
    if not names:
        print("Error: the server serves no model yet; pull or serve one first", file=sys.stderr)
        return None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print(f"Error: name the model with --model (the server has: {', '.join(names)})", file=sys.stderr)
        return None
    tools = {n for n in names if "tools" in (said[n] if n in said else _capabilities(client, n))}
    ordered = sorted(names, key=lambda n: (n not in tools, n))
    for i, n in enumerate(ordered, 1):
        also = f"  (also {', '.join(aliases[n])})" if aliases[n] else ""
        print(f"{i:>3}. {n}{'  (tools)' if n in tools else ''}{also}")
    while True:
        try:
            answer = input("Select a model [1]: ").strip() or "1"
        except EOFError:
            return None
        if answer.isdigit() and 1 <= int(answer) <= len(ordered):
            return ordered[int(answer) - 1]
        if answer in names or any(answer in a for a in aliases.values()):
            return answer
        print(f"enter a number from 1 to {len(ordered)}, or a model's name")


def _capabilities(client: Client, name: str) -> list[str]:
    try:
        return list(client.json("POST", "/api/show", {"model": name}).get("capabilities") or [])
    except ApiError:
        return []
