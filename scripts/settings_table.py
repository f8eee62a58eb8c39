#!/usr/bin/env python3
"""Print the settings table of docs/configuration.md from the Settings class (a test checks the page matches).

Usage: scripts/settings_table.py [--update docs/configuration.md]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic_core import PydanticUndefined  # noqa: E402

from vllama_proxy.settings import Settings  # noqa: E402


def table() -> str:
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            value = field.default_factory()
            # a computed path (state_dir) differs per machine: its description says how
            default = "" if isinstance(value, Path) else json.dumps(value)
        elif field.default is PydanticUndefined or field.default is None:
            default = ""
        else:
            default = str(field.default)
        flag = "`-- ARGS`" if name == "vllm_args" else f"`--{name.replace('_', '-')}`"
        env = f"`VLLAMA_{name.upper()}`"
        rows.append(f"| {flag} | {env} | {'`' + default + '`' if default else ''} | {field.description} |")
    return "\n".join(rows)


def main() -> None:
    """Print the table; with ``--update docs/configuration.md`` replace the table in that file."""
    args = sys.argv[1:]
    if args in (["-h"], ["--help"]):
        print(__doc__.strip())
    elif len(args) == 2 and args[0] == "--update":
        path = Path(args[1])
        text = path.read_text()
        start = text.index("| flag | environment |")
        end = text.index("\n\n", start)
        path.write_text(text[:start] + table() + text[end:])
    elif not args:
        print(table())
    else:
        print(__doc__.strip(), file=sys.stderr)
        raise SystemExit(2)

if __name__ == "__main__":
    main()
