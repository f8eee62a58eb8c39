"""``vllama keys list|create|update|rotate|revoke``: the server's API keys, managed through ``/api/keys`` with an
admin key (``OLLAMA_API_KEY``; ``docs/operations.md``). A new or rotated key's secret is printed once, alone on
stdout's last line (``vllama keys create bob | tail -1`` keeps just the secret); ``--json`` prints the server's
answer as it came.
"""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from typing import Any

import orjson

from .api_client import Client
from .formatting import table

LIMITS = ("max_in_flight", "max_tokens", "rpm", "tpm", "budget_tokens", "budget_period", "priority", "weight",
          "user_max_in_flight", "user_rpm", "user_tpm", "user_budget_tokens", "user_header")
#: A trusted front's switches (``docs/configuration.md`` "Many users"): ``--trusted-front``/``--no-trusted-front``...
SWITCHES = ("trusted_front", "user_body", "hash_end_users")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``keys`` command's actions and their options."""
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="every key: the keys file's (read-only) and the minted ones")
    ls.add_argument("--json", action="store_true", help="print the server's JSON answer")
    for name, summary in (("create", "mint a key; its secret is printed once"), ("update", "change a minted key's scope, limits, expiry or note")):
        a = sub.add_parser(name, help=summary)
        a.add_argument("name")
        a.add_argument("--role", choices=("user", "admin", "metrics"), help="its role (create: user)")
        a.add_argument("--models", help="comma-separated names or shell patterns it may use (create: every model; '' every model)")
        a.add_argument("--expires-in", help="it expires after this long: 30d, 12h, 90m or seconds")
        a.add_argument("--expires-at", help="it expires at this UTC time (RFC 3339); 'never' clears an expiry (update)")
        a.add_argument("--note", help="a note for operators")
        for limit in LIMITS:
            a.add_argument(f"--{limit.replace('_', '-')}", dest=limit,
                           type=str if limit in ("budget_period", "user_header") else float if limit == "weight" else int)
        for switch in SWITCHES:
            a.add_argument(f"--{switch.replace('_', '-')}", dest=switch, action=argparse.BooleanOptionalAction, default=None)
        a.add_argument("--json", action="store_true", help="print the server's JSON answer")
    for name, summary in (("rotate", "a new secret for a minted key (the old one is refused), printed once"),
                          ("revoke", "revoke a minted key for good")):
        a = sub.add_parser(name, help=summary)
        a.add_argument("name")
        a.add_argument("--json", action="store_true", help="print the server's JSON answer")
    au = sub.add_parser("audit", help="who did what to which key, when (newest first)")
    au.add_argument("--limit", type=int, default=50)
    au.add_argument("--json", action="store_true", help="print the server's JSON answer")


def _fields(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.role is not None:
        out["role"] = args.role
    if args.models is not None:
        out["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.expires_in is not None:
        out["expires_in"] = args.expires_in
    if args.expires_at is not None:
        out["expires_at"] = None if args.expires_at == "never" else args.expires_at
    if args.note is not None:
        out["note"] = args.note
    for limit in (*LIMITS, *SWITCHES):
        if getattr(args, limit) is not None:
            out[limit] = getattr(args, limit)
    return out


def _print_json(body: Any) -> None:
    sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")


def _limits(k: dict[str, Any]) -> str:
    parts = [f"{f}={k[f]}" for f in ("max_in_flight", "max_tokens", "rpm", "tpm") if k.get(f) is not None]
    if k.get("budget_tokens") is not None:
        parts.append(f"budget={k['budget_tokens']}/{k['budget_period']}")
    if k.get("trusted_front"):
        parts.append("trusted_front")
        parts += [f"{f}={k[f]}" for f in ("user_max_in_flight", "user_rpm", "user_tpm", "user_budget_tokens") if k.get(f) is not None]
    return " ".join(parts) or "-"


def _rows(keys: list[dict[str, Any]]) -> str:
    head = ["NAME", "SOURCE", "STATE", "PREFIX", "ROLE", "MODELS", "LIMITS", "EXPIRES", "NOTE"]
    return table([head, *[[k["name"], k["source"], k["state"], k.get("prefix") or "-", k["role"], ",".join(k["models"]) or "*",
                           _limits(k), k.get("expires_at") or "never", k.get("note") or ""] for k in keys]])


def cmd_keys(client: Client, args: argparse.Namespace) -> int:
    """Run ``vllama keys ACTION``; 0 done (a server's refusal is printed by the caller, status 1)."""
    name = urllib.parse.quote(getattr(args, "name", "") or "", safe="")
    if args.action == "list":
        body = client.json("GET", "/api/keys")
    elif args.action == "audit":
        body = client.json("GET", f"/api/keys/audit?limit={args.limit}")
        if not args.json:
            sys.stdout.write(table([["TIME", "WHO", "ACTION", "KEY", "DETAIL"],
                                    *[[a["time"], a["who"], a["action"], a["key"], orjson.dumps(a["detail"]).decode()]
                                      for a in body["audit"]]]))
            return 0
    elif args.action == "create":
        body = client.json("POST", "/api/keys", {"name": args.name, **_fields(args)})
    elif args.action == "update":
        body = client.json("PATCH", f"/api/keys/{name}", _fields(args))
    elif args.action == "rotate":
        body = client.json("POST", f"/api/keys/{name}/rotate")
    else:
        body = client.json("POST", f"/api/keys/{name}/revoke")
    if args.json:
        _print_json(body)
        return 0
    sys.stdout.write(_rows(body["keys"] if "keys" in body else [body["key"]]))
    if "secret" in body:
        print("The secret, shown this once (the server keeps only its hash):", file=sys.stderr)
        sys.stdout.write(body["secret"] + "\n")
    return 0
