"""The client commands' command line: one argparse parser, one subparser per command, each
naming its handler (``set_defaults(func=...)``, the handlers in ``commands.py``), and
:func:`main`, which parses, builds the :class:`~.api_client.Client` and turns what went
wrong into a line on stderr and an exit status.

``vllama COMMAND ...`` reaches :func:`main` from ``vllama_proxy/cli.py``; ``vllama serve``
and ``vllama batch`` have their own parsers (``settings/``, ``batch.py``); ``vllama help
[COMMAND]`` is ``cli.py``'s (it prints any of the three).
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys

from vllama_proxy import CliParser

from . import commands, keys, launch, usage
from .api_client import ApiError, Client, ConnectError
from .create import cmd_create

HOST_HELP = "server URL (default: OLLAMA_HOST, else http://127.0.0.1:11434)"


def parse_think(value: str | None) -> bool | str | None:
    """``--think[=LEVEL]``: ``true``/``false`` (and 1/0, yes/no, on/off) or a level.

    Raises:
        argparse.ArgumentTypeError: any other value.
    """
    if value is None:
        return None
    value = value.lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    if value in ("low", "medium", "high", "max"):
        return value
    raise argparse.ArgumentTypeError(f"invalid --think value {value!r} (true, false, low, medium, high, max)")


def build_parser() -> CliParser:
    """``vllama``'s client commands: the parser, with one subparser per command (its ``--help``,
    its arguments, its handler as ``func``), in the order ``vllama --help`` lists them."""
    parser = CliParser(prog="vllama", description="The Ollama-style client commands of vllama.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CliParser)

    def command(name: str, func, summary: str, description: str) -> CliParser:
        p = sub.add_parser(name, help=summary, description=description)
        p.add_argument("--host", help=HOST_HELP)
        p.set_defaults(func=func)
        return p

    p = command("list", commands.cmd_list, "list the models a running server serves", "List the models the server serves.")
    p.add_argument("prefix", nargs="?", help="only names starting with this")

    command("ps", commands.cmd_ps, "list the running models", "List the running models.")

    p = command("create", cmd_create, "create a model from a Modelfile: `vllama create NAME [-f Modelfile]`",
                "Create a model from a Modelfile (served by its base model's vLLM; a local model directory is uploaded).")
    p.add_argument("model", metavar="NAME")
    p.add_argument("-f", "--file", help='name of the Modelfile (default "Modelfile"; none there: the current directory is the model)')
    p.add_argument("-q", "--quantize", help="quantize the model to this level (Ollama's; vLLM serves published "
                   "quantizations: vllama's server refuses it and says so)")
    p.add_argument("--experimental", action="store_true",
                   help="Ollama's direct safetensors import; not needed with vLLM (a note, then created as without it)")

    p = command("show", commands.cmd_show, "show a model's details (--modelfile, --template, --parameters)",
                "Show a model's details.")
    p.add_argument("model")
    for flag in ("modelfile", "template", "parameters", "license"):
        p.add_argument(f"--{flag}", action="store_true", help=f"print only the {flag}")

    p = command("pull", commands.cmd_pull, "pull a model (succeeds for a model that is already served)",
                "Pull a model (vllama: succeeds for a served model).")
    p.add_argument("model")
    p.add_argument("--insecure", action="store_true", help="allow insecure registries")

    p = command("run", commands.cmd_run, "chat with a model: `vllama run M [PROMPT]`, piped stdin, or interactively",
                "Chat with a model: PROMPT, piped stdin, or interactively.")
    p.add_argument("model", nargs="?")  # checked in main: argparse would call the prompt required too
    p.add_argument("prompt", nargs="*", help="the prompt (none: piped stdin, or an interactive session)")
    p.add_argument("--verbose", action="store_true", help="show timings after each answer")
    p.add_argument("--think", type=parse_think, metavar="[=LEVEL]",
                   help="ask for thinking and show it (--think, --think=false, --think=high)")
    p.add_argument("--hidethinking", action="store_true", help="think, but do not show the thinking")
    p.add_argument("--nowordwrap", dest="wordwrap", action="store_false",
                   help="do not wrap words to the next line automatically")
    p.add_argument("--format", help='response format, e.g. "json"')
    p.add_argument("--keepalive", help='how long the model stays loaded, e.g. "5m"')
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds to wait for the model to load (600)")

    p = command("stop", commands.cmd_stop, "ask the server to unload a model", "Ask the server to unload a model.")
    p.add_argument("model")

    p = command("cp", commands.cmd_cp, "give a model another name (an alias): `vllama cp SOURCE DESTINATION`",
                "Give a model another name (an alias every client can use).")
    p.add_argument("source")
    p.add_argument("destination")

    p = command("rm", commands.cmd_rm, "remove a name made with cp, or a pulled model from the cache",
                "Remove a name made with cp, or a pulled model from the cache.")
    p.add_argument("models", nargs="+", metavar="model")

    p = command("usage", usage.cmd_usage, "tokens and requests by key, model and day or month (the server's usage ledger)",
                "Tokens and requests by key, model and day or month, from the server's usage ledger (GET /api/usage): "
                "every key's with an admin key (OLLAMA_API_KEY), a user key's own.")
    p.add_argument("--since", help="from this UTC date, YYYY-MM-DD or YYYY-MM (default: this month; with --by month, this year)")
    p.add_argument("--by", choices=("day", "month", "user"), default="day",
                   help="one row per key, model and day (default) or month; user: per month and end user of a trusted front")
    p.add_argument("--key", help="only this key's usage (an admin's choice)")
    p.add_argument("--user", help="only this end user's usage (a trusted front's, api/end_users.py)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the server's JSON answer")
    fmt.add_argument("--csv", action="store_true", help="print CSV")
    p = command("keys", keys.cmd_keys, "mint, list, change, rotate and revoke the server's API keys (an admin key)",
                "Mint, list, change, rotate and revoke the server's API keys through /api/keys, with an admin key "
                "(OLLAMA_API_KEY): `vllama keys list|create NAME|update NAME|rotate NAME|revoke NAME|audit`.")
    keys.add_arguments(p)
    p = command("launch", launch.cmd_launch, "start a coding agent (claude, codex, opencode, copilot, qwen, kimi, pool, droid) pointed at vllama",
                "Start a coding agent pointed at vllama: `vllama launch TOOL [--model M] [--config] [-- TOOL ARGS]`.")
    launch.add_arguments(p)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    """The parser's one table of commands: argparse's subparsers action (name -> subparser, and
    each one's ``help``), the same object ``vllama --help`` and the error messages read."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def summaries() -> dict[str, str]:
    """Each command's one-line summary (its ``help``), for ``vllama --help``."""
    return {a.dest: a.help or "" for a in _subcommands(build_parser())._get_subactions()}


#: The client commands, in the order ``vllama --help`` lists them.
COMMANDS = tuple(_subcommands(build_parser()).choices)


def main(command: str, argv: list[str]) -> int:
    """Run client ``command`` (one of ``COMMANDS``) with its arguments; returns the exit status
    (0 done, 1 an error the server or the connection reported, 2 a usage error, 130 Ctrl-C)."""
    sub = _subcommands(build_parser()).choices.get(command)
    if sub is None:
        print(f"vllama: unknown command {command!r} (one of {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    if command == "run":  # a bare --think must not swallow the model name
        argv = ["--think=true" if a == "--think" else a for a in argv]
    argv, extra = launch.split_extra(argv) if command == "launch" else (argv, [])
    try:
        # flags may follow the prompt words; keys has actions (subparsers, which intermixed parsing refuses)
        args = sub.parse_args(argv) if command == "keys" else sub.parse_intermixed_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if extra:
        args.args = extra
    if command == "run" and args.model is None:  # Ollama: "requires at least 1 arg(s)"; the prompt is optional
        print("vllama run: error: name a model: vllama run MODEL [PROMPT...]\n(`vllama run --help` lists the options)",
              file=sys.stderr)
        return 2
    if command == "run" and args.hidethinking and args.think is None:
        args.think = True
    try:
        client = Client(args.host)
    except ValueError as e:
        print(f"Error: invalid host: {e}", file=sys.stderr)
        return 1
    try:
        return args.func(client, args)
    except ConnectError as e:
        print(f"Error: could not connect to vllama at {e} (is `vllama serve` running?)", file=sys.stderr)
    except ApiError as e:
        print(f"Error: {e}", file=sys.stderr)
    except (OSError, http.client.HTTPException) as e:
        if isinstance(e, BrokenPipeError):  # `vllama list | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        print(f"Error: lost the connection to vllama at {client.url}: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1
