#!/usr/bin/env python3
"""Print the README's settings table from the Settings class (a test checks the README matches)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic_core import PydanticUndefined  # noqa: E402

from vllama_proxy.settings import Settings  # noqa: E402


def main() -> None:
    print("| flag | environment | default | meaning |")
    print("|---|---|---|---|")
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            default = json.dumps(field.default_factory())
        elif field.default is PydanticUndefined or field.default is None:
            default = ""
        else:
            default = str(field.default)
        flag = "`-- ARGS`" if name == "vllm_args" else f"`--{name.replace('_', '-')}`"
        env = f"`VLLAMA_{name.upper()}`"
        print(f"| {flag} | {env} | {'`' + default + '`' if default else ''} | {field.description} |")


if __name__ == "__main__":
    main()
