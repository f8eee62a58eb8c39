"""What ``vllama run M``'s ``>>>`` session reads and says, without the server: Ollama's slash
commands' help texts, ``/set parameter`` values, word wrapping, multi-line entries. The session
itself (``commands.Session``) sends the chat.

The commands, their answers and their help texts are Ollama's (``cmd/interactive.go``
``generateInteractive``), so a user of ``ollama run`` finds what they know: ``/set parameter
NAME VALUE`` (the value typed as Ollama's ``api.FormatParams`` types it), ``/set system``
(one line, or ``\"\"\"`` for several), ``/set [no]history``, ``/set [no]wordwrap``, ``/set
format json``/``noformat``, ``/set verbose``/``quiet``, ``/set think [LEVEL]``/``nothink``,
``/show info|license|modelfile|parameters|system|template``, ``/load MODEL``, ``/save MODEL``
(``/api/create``: answered by whatever the server supports), ``/list``, ``/clear``, ``/bye``,
``/?`` and ``/help [set|show|shortcuts]``. Any other line starting with ``/`` gets
``Unknown command '/x'. Type /? for help`` and is not sent to the model.
"""

from __future__ import annotations

from typing import Any

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


class WordWrap:
    """Streamed text wrapped at ``width`` columns between words (Ollama's ``wordwrap``, on by default on a terminal)."""

    def __init__(self, out, width: int) -> None:
        self.out, self.width = out, max(width, 10)
        self.col = 0
        self.word = ""

    def write(self, text: str) -> None:
        for ch in text:
            if ch == "\n":
                self._flush()
                self.out.write("\n")
                self.col = 0
            elif ch == " ":
                self._flush()
                if self.col < self.width:
                    self.out.write(" ")
                    self.col += 1
            else:
                self.word += ch
                if len(self.word) >= self.width:  # longer than a line: break it
                    self._flush()

    def _flush(self) -> None:
        if not self.word:
            return
        if self.col and self.col + len(self.word) > self.width:
            self.out.write("\n")
            self.col = 0
        self.out.write(self.word)
        self.col += len(self.word)
        self.word = ""

    def close(self) -> None:
        self._flush()

    def flush(self) -> None:
        self.out.flush()


def go_value(value: Any) -> str:
    """A parameter as Go's ``%v`` prints it: ``[a b]`` for a list, ``true`` for a bool."""
    if isinstance(value, list):
        return "[" + " ".join(map(str, value)) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
