"""``vllama usage``: the server's usage ledger (``GET /api/usage``), by key, model and day or month.

An admin key (``OLLAMA_API_KEY``) sees every key's usage, a user key its own; on a server without
keys anyone may ask. Prints a table, or ``--json`` (the route's answer as it came) or ``--csv``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import urllib.parse
from typing import Any

import orjson

from .api_client import Client
from .formatting import table

COLUMNS = ("period", "key", "model", "requests", "errors", "prompt_tokens", "output_tokens")
#: ``--by user``: the same by month, with each trusted front's end user (``api/end_users.py``).
USER_COLUMNS = ("period", "key", "end_user", "model", "requests", "errors", "prompt_tokens", "output_tokens")


def cmd_usage(client: Client, args: argparse.Namespace) -> int:
    """Print the usage from ``--since`` (default: this month by day, this year by month)."""
    query = {"by": args.by}
    if args.since:
        query["since"] = args.since
    if args.key:
        query["key"] = args.key
    if getattr(args, "user", None):
        query["user"] = args.user
    columns = USER_COLUMNS if args.by == "user" or "user" in query else COLUMNS
    body = client.json("GET", "/api/usage?" + urllib.parse.urlencode(query))
    if args.json:
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    rows: list[dict[str, Any]] = body.get("usage") or []
    if args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for r in rows:
            writer.writerow(["" if r.get(c) is None else r[c] for c in columns])
        return 0
    head = [("MONTH" if args.by == "user" else args.by.upper()), "KEY", *(["END USER"] if columns is USER_COLUMNS else []),
            "MODEL", "REQUESTS", "ERRORS", "PROMPT TOKENS", "OUTPUT TOKENS"]
    sys.stdout.write(table([head, *[["-" if r.get(c) is None else str(r[c]) for c in columns] for r in rows]]))
    budgets = body.get("budgets") or []
    if budgets:
        sys.stdout.write("\n" + table([["KEY", "BUDGET", "USED", "RESETS"],
                                      *[[b["key"], f"{b['budget_tokens']} per {b['period']}", str(b["used"]), b["resets_at"]]
                                        for b in budgets]]))
    return 0

