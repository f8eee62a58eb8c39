"""The ``vllama`` command.

``vllama serve [settings] [-- vllm serve arguments]``: with ``--upstream URL`` it
proxies a running vLLM server; with ``--model M`` it also launches and supervises
``vllm serve M``. Everything after ``--`` goes to vLLM untouched.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .settings import Settings

if TYPE_CHECKING:
    from .models.resolved import ResolvedModels

USAGE = """usage: vllama COMMAND [args]   (vllama serve [options] [-- vllm serve arguments])

Commands:
  -v, --version  print the version of vllama (and of the server at OLLAMA_HOST)
  serve    serve the Ollama API in front of vLLM (see `vllama serve --help`)
  batch    run an OpenAI-batch JSONL file through a running server (see `vllama batch --help`)
  help     help about any command: `vllama help COMMAND`
"""


def usage() -> str:
    """``vllama --help``: the server's commands, then each client command's summary (``client/main.py``)."""
    from vllama_proxy.client.main import summaries

    return USAGE + "".join(f"  {name:<8} {summary}\n" for name, summary in summaries().items())


def help_command(topics: list[str]) -> int:
    """``vllama help [COMMAND]``, as the ``help`` command Ollama's CLI gets from cobra: the command's
    ``--help``, the usage with no topic, ``Unknown help topic [`x`]`` and the usage for an unknown
    one (exit 0, as cobra's). Returns the exit status."""
    if not topics or topics[0] == "help":
        print(usage(), end="")
        return 0
    topic = topics[0]
    try:
        if topic == "serve":
            load_settings(["--help"])
        elif topic == "batch":
            from vllama_proxy.client.batch import main as batch_main

            return batch_main(["--help"])
        else:
            from vllama_proxy.client.main import COMMANDS
            from vllama_proxy.client.main import main as client_main

            if topic in COMMANDS:
                return client_main(topic, ["--help"])
            print(f"Unknown help topic [`{topic}`]\n{usage()}", end="")
    except SystemExit as e:  # argparse's --help exits 0 once printed
        return e.code if isinstance(e.code, int) else 0
    return 0


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[our args] -- [vllm args]`` -> ``(ours, vllm's)``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def config_path(argv: list[str]) -> Path | None:
    """The config file named by ``--config PATH``/``--config=PATH`` in ``argv``, else ``$VLLAMA_CONFIG``.

    Read before the settings themselves, since the file is one of their sources.
    """
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if a.startswith("--config="):
            return Path(a.split("=", 1)[1])
    value = os.environ.get("VLLAMA_CONFIG")
    return Path(value) if value else None


def load_settings(argv: list[str]) -> Settings:
    """Settings from flags ``argv`` (after ``serve``), the environment, ``.env`` and the config file.

    Raises:
        SystemExit: invalid flags, values or config file (message on stderr, exit 2).
    """
    from pydantic import ValidationError

    from .settings import Settings, cli_source

    ours, theirs = split_passthrough(argv)
    try:
        settings = Settings.load(config_path(ours), _cli_settings_source=cli_source(ours),
                                 **({"vllm_args": theirs} if theirs else {}))
    except ValidationError as e:
        for err in e.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            print(f"vllama serve: invalid {loc}: {msg}" if loc else f"vllama serve: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as e:  # the config file: missing, not TOML, unknown keys
        print(f"vllama serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return settings


def resolve_models(settings: Settings) -> ResolvedModels:
    """The library loaded and the configured models resolved through it, once, at start
    (``models/resolved.py``).

    Raises:
        SystemExit: a library file that cannot be read or breaks the schema, or a library name the
            table does not know (one line on stderr saying what is close, exit 2, as for a bad flag).
    """
    from vllama_proxy.errors import ModelNotFound
    from vllama_proxy.models.library_schema import LibraryError
    from vllama_proxy.models.resolved import resolve_models as resolve

    try:
        return resolve(settings.configured_models(), library_path=settings.library, state_dir=settings.state_dir,
                       detect_parsers=settings.detect_parsers)
    except LibraryError as e:
        print(f"vllama serve: {e}", file=sys.stderr)
    except ModelNotFound as e:
        print(f"vllama serve: {e.message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``vllama`` script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command in ("-v", "--version"):
        from vllama_proxy.client.commands import print_version

        raise SystemExit(print_version())
    if command == "help":
        raise SystemExit(help_command(rest))
    if command == "batch":
        from vllama_proxy.client.batch import main as batch_main

        raise SystemExit(batch_main(rest))
    if command != "serve":  # the client commands: nothing of the server is imported for them
        from vllama_proxy.client.main import COMMANDS
        from vllama_proxy.client.main import main as client_main

        if command in COMMANDS:
            raise SystemExit(client_main(command, rest))
        print(f"vllama: unknown command {command!r}\n{usage()}", end="", file=sys.stderr)
        raise SystemExit(2)
    from .logs import configure_logging

    settings = load_settings(rest)
    configure_logging(settings.log_level, settings.log_format)  # before resolving: it logs what it detects
    resolved = resolve_models(settings)
    from vllama_proxy.supervisor.sizing import resolve

    settings, front = resolve(settings, list(resolved.specs))  # --workers auto -> a number, and each vLLM's API servers
    if settings.workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # Before prometheus-client is first imported: every worker writes its metric
        # values there and /metrics on any worker aggregates them.
        metrics_dir = tempfile.mkdtemp(prefix="vllama-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        atexit.register(shutil.rmtree, metrics_dir, True)
    from vllama_proxy.api.app import check_config

    try:  # a configuration the app could not serve with: one line, before anything is built or started
        check_config(settings)
    except ValueError as e:
        print(f"vllama serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from vllama_proxy.front.site import run_loop

    if settings.upstream_url:
        from vllama_proxy.front.server import serve_upstream

        run_loop(serve_upstream(settings, resolved, front))
        return
    if resolved.specs or settings.on_demand:  # none configured: local models start on demand
        from vllama_proxy.front.server import serve_supervised

        run_loop(serve_supervised(settings, resolved, front))
        return
    print("vllama serve: give --upstream URL (proxy a running vLLM), --model M (launch vLLM), "
          "--config FILE with [[models]], or leave --on-demand on (local models start when named)", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
