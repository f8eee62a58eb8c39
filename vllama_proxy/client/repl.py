"""The ``>>>`` session of ``vllama run M``: Ollama's slash commands and their help texts,
``/set parameter`` values, multi-line entries, and the :class:`Session` that holds the
conversation and sends each turn through ``chat.py``.

The commands, their answers and help texts are Ollama's (``cmd/interactive.go``
``generateInteractive``; ``/set parameter`` values typed as ``api.FormatParams`` types them), so a
user of ``ollama run`` finds what they know; the list is in ``docs/api.md``. Any other line starting
with ``/`` gets ``Unknown command '/x'. Type /? for help`` and is not sent to the model.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from .api_client import ApiError, Client
from .chat import chat_once, preload
from .formatting import RESET, list_table, show_info

USAGE = '''Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use """ to begin a multi-line message.
'''

USAGE_SET = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set history           Enable history
  /set nohistory         Disable history
  /set wordwrap          Enable wordwrap
  /set nowordwrap        Disable wordwrap
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think             Enable thinking
  /set nothink           Disable thinking
"""

USAGE_SHOW = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template
"""

USAGE_PARAMETERS = """Available Parameters:
  /set parameter seed <int>             Random number seed
  /set parameter num_predict <int>      Max number of tokens to predict
  /set parameter top_k <int>            Pick from top k num of tokens
  /set parameter top_p <float>          Pick token based on sum of probabilities
  /set parameter min_p <float>          Pick token based on top token probability * min_p
  /set parameter num_ctx <int>          Set the context size
  /set parameter temperature <float>    Set creativity level
  /set parameter repeat_penalty <float> How strongly to penalize repetitions
  /set parameter repeat_last_n <int>    Set how far back to look for repetitions
  /set parameter num_gpu <int>          The number of layers to send to the GPU
  /set parameter stop <string> <string> ...   Set the stop parameters
"""

# GNU readline (Python's input()) has these; Ollama's Ctrl + g (an external editor) it has not.
USAGE_SHORTCUTS = """Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
   Alt + b            Move back (left) one word
   Alt + f            Move forward (right) one word
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor

  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit vllama (/bye)
"""


#: Ollama's ``api.Options`` fields by the type ``api.FormatParams`` converts a value to (``stop``: a list).
PARAMETER_TYPES: dict[str, type] = {
    **dict.fromkeys(("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "mirostat", "num_ctx", "num_batch",
                     "num_gpu", "main_gpu", "num_thread", "min_tokens"), int),
    **dict.fromkeys(("top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", "mirostat_tau", "mirostat_eta", "tfs_z"), float),
    **dict.fromkeys(("penalize_newline", "numa", "use_mmap", "use_mlock", "low_vram", "f16_kv", "vocab_only",
                     "ignore_eos"), bool),
    "stop": list,
}


def parse_parameter(name: str, values: list[str]) -> Any:
    """``/set parameter NAME VALUE...`` -> the option's value, typed as Ollama's ``api.FormatParams`` does.

    Raises:
        ValueError: ``unknown parameter 'x'``, or ``invalid int value [x]`` (float, bool likewise).
    """
    kind = PARAMETER_TYPES.get(name)
    if kind is None:
        raise ValueError(f"unknown parameter '{name}'")
    if kind is list:
        return list(values)
    raw = values[0]
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "t", "f"):
                raise ValueError
            return raw.lower() in ("true", "1", "t")
        return kind(raw)
    except ValueError:
        raise ValueError(f"invalid {kind.__name__} value [{raw}]") from None


def read_entry(prompt=input) -> str | None:
    """One entry from the terminal; ``\"\"\"`` opens several lines (also after ``/set system``),
    closed by a line ending in ``\"\"\"``. None on Ctrl-D."""
    try:
        line = prompt(">>> ")
        head, quotes, rest = line.partition('"""')
        if not quotes or head.strip() not in ("", "/set system") or rest.endswith('"""'):
            return line
        text = line
        while True:
            more = prompt("... ")
            text += "\n" + more
            if more.endswith('"""'):
                return text
    except EOFError:
        print()
        return None


def go_value(value: Any) -> str:
    """A parameter as Go's ``%v`` prints it: ``[a b]`` for a list, ``true`` for a bool."""
    if isinstance(value, list):
        return "[" + " ".join(map(str, value)) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Session:
    """What one ``>>>`` session holds: the messages, the system message, the options set with
    ``/set parameter``; the rest (verbose, think, format, wordwrap) lives on ``args``."""

    def __init__(self, client: Client, args: argparse.Namespace) -> None:
        self.client, self.args = client, args
        self.messages: list[dict[str, Any]] = []
        self.system = ""
        self.args.options = getattr(args, "options", None) or {}
        try:
            import readline
        except ImportError:  # pragma: no cover - Windows
            readline = None
        self.readline = readline

    # -- commands ----------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Apply slash command ``line`` (Ollama's, ``py``); True to end the session."""
        words = line.split()
        name = words[0]
        if name in ("/bye", "/exit"):
            return True
        if name in ("/?", "/help"):
            topic = words[1] if len(words) > 1 else ""
            text = {"set": USAGE_SET, "/set": USAGE_SET, "show": USAGE_SHOW, "/show": USAGE_SHOW,
                    "shortcut": USAGE_SHORTCUTS, "shortcuts": USAGE_SHORTCUTS}.get(topic, "" if topic else USAGE)
            sys.stderr.write(text + ("\n" if text else ""))
        elif name == "/clear":
            self.messages = [{"role": "system", "content": self.system}] if self.system else []
            print("Cleared session context")
        elif name == "/set":
            self.set(words[1:], line)
        elif name == "/show":
            self.show(words[1:])
        elif name == "/load":
            self.load(words[1:])
        elif name == "/save":
            self.save(words[1:])
        elif name == "/list":
            models = self.client.json("GET", "/api/tags").get("models") or []
            sys.stdout.write(list_table(models, words[1] if len(words) > 1 else None))
        else:
            print(f"Unknown command '{name}'. Type /? for help")
        return False

    def set(self, words: list[str], line: str) -> None:
        args = self.args
        if not words:
            sys.stderr.write(USAGE_SET + "\n")
            return
        what = words[0]
        modes = {"verbose": ("verbose", True), "quiet": ("verbose", False), "wordwrap": ("wordwrap", True),
                 "nowordwrap": ("wordwrap", False)}
        if what in modes:
            setattr(args, *modes[what])
            print(f"Set '{what}' mode.")
        elif what in ("history", "nohistory"):
            if self.readline is not None:
                self.readline.set_auto_history(what == "history")
        elif what == "think":
            args.think = words[1] if len(words) > 1 else True
            print(f"Set 'think' mode to '{words[1]}'." if len(words) > 1 else "Set 'think' mode.")
        elif what == "nothink":
            args.think = False
            print("Set 'nothink' mode.")
        elif what == "format":
            if len(words) < 2 or words[1] != "json":
                print("Invalid or missing format. For 'json' mode use '/set format json'")
            else:
                args.format = "json"
                print("Set format to 'json' mode.")
        elif what == "noformat":
            args.format = None
            print("Disabled format.")
        elif what == "parameter":
            if len(words) < 3:
                sys.stderr.write(USAGE_PARAMETERS + "\n")
                return
            try:
                args.options[words[1]] = parse_parameter(words[1], words[2:])
            except ValueError as e:
                print(f'Couldn\'t set parameter: "{e}"')
                return
            print(f"Set parameter '{words[1]}' to '{', '.join(words[2:])}'")
        elif what == "system":
            if len(words) < 2:
                sys.stderr.write(USAGE_SET + "\n")
                return
            text = line.split("system", 1)[1].strip()
            if text.startswith('"""'):
                text = text[3:].removesuffix('"""').strip("\n")
            self.system = text
            message = {"role": "system", "content": text}
            if self.messages and self.messages[-1]["role"] == "system":
                self.messages[-1] = message
            else:
                self.messages.append(message)
            print("Set system message.")
        else:
            print(f"Unknown command '/set {what}'. Type /? for help")

    def show(self, words: list[str]) -> None:
        if not words:
            sys.stderr.write(USAGE_SHOW + "\n")
            return
        try:
            info = self.client.json("POST", "/api/show", {"model": self.args.model})
        except ApiError as e:
            print("error: couldn't get model")
            print(f"Error: {e}", file=sys.stderr)
            return
        what = words[0]
        if what == "info":
            sys.stderr.write(show_info(info) + "\n")
        elif what == "license":
            print(info.get("license") or "No license was specified for this model.")
        elif what == "modelfile":
            print(info.get("modelfile") or "")
        elif what == "parameters":
            print("Model defined parameters:")
            params = info.get("parameters") or ""
            if not params:
                print("  No additional parameters were specified for this model.")
            for row in params.splitlines():
                print(f"  {row}")
            print()
            if self.args.options:
                print("User defined parameters:")
                for key, value in self.args.options.items():
                    print(f"  {key:<30} {go_value(value)}")
                print()
        elif what == "system":
            system = self.system or info.get("system") or ""
            print(system + "\n" if system else "No system message was specified for this model.")
        elif what == "template":
            print(info.get("template") or "No prompt template was specified for this model.")
        else:
            print(f"Unknown command '/show {what}'. Type /? for help")

    def load(self, words: list[str]) -> None:
        if len(words) != 1:
            print("Usage:\n  /load <modelname>")
            return
        previous = self.args.model
        self.args.model = words[0]
        print(f"Loading model '{words[0]}'")
        try:
            preload(self.client, self.args)
        except ApiError as e:
            self.args.model = previous
            if e.status == 404:
                print(f"Couldn't find model '{words[0]}'")
            else:
                print(f"Error: {e}", file=sys.stderr)
            return
        self.messages = []

    def save(self, words: list[str]) -> None:
        if len(words) != 1:
            print("Usage:\n  /save <modelname>")
            return
        body: dict[str, Any] = {"model": words[0], "from": self.args.model, "messages": self.messages}
        if self.system:  # saved as the model's SYSTEM, not also as a MESSAGE (it would come twice in each chat)
            body["system"] = self.system
            body["messages"] = [m for m in self.messages if m["role"] != "system"]
        if self.args.options:
            body["parameters"] = self.args.options
        try:  # its progress lines are read to the end and dropped, as Ollama's /save does
            self.client.json("POST", "/api/create", body)
        except ApiError as e:
            print(f"error: {e}")
            return
        print(f"Created new model '{words[0]}'")

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> int:
        """The ``>>>`` loop: history kept, /bye or Ctrl-D exits, Ctrl-C stops an answer."""
        while True:
            try:
                text = read_entry()
            except KeyboardInterrupt:
                print("\nUse Ctrl + d or /bye to exit.")
                continue
            if text is None:
                return 0
            stripped = text.strip()
            if not stripped:
                continue
            if stripped.startswith("/"):
                if self.command(stripped):
                    return 0
                continue
            if stripped.startswith('"""'):
                text = stripped[3:].removesuffix('"""').strip("\n")
            self.messages.append({"role": "user", "content": text})
            try:
                self.messages.append(chat_once(self.client, self.args, self.messages))
            except KeyboardInterrupt:
                self.messages.pop()  # the unanswered question leaves the history
                sys.stdout.write((RESET if sys.stdout.isatty() else "") + "\n")
            except ApiError as e:
                self.messages.pop()
                print(f"Error: {e}", file=sys.stderr)
            print()


def interactive(client: Client, args: argparse.Namespace) -> int:
    """Chat with ``args.model`` at the ``>>>`` prompt until /bye or Ctrl-D; returns the exit status.

    Ctrl-C stops an answer even in a process that started with SIGINT ignored (a background job of a
    non-interactive shell or a script passes that on): Python raises ``KeyboardInterrupt`` only for a SIGINT
    it handles, so the handler is set here, as Ollama's CLI catches the signal itself (``cmd/cmd.go``: ``signal.Notify``)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return Session(client, args).run()

