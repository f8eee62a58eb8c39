"""Typed keys for the app-scoped objects every handler reaches through ``request.app``."""

from __future__ import annotations

from aiohttp import web

from .catalog import Catalog
from .settings import Settings
from .supervisor.core import Supervisor
from .upstream import Upstream

SETTINGS = web.AppKey("settings", Settings)
UPSTREAM = web.AppKey("upstream", Upstream)
CATALOG = web.AppKey("catalog", Catalog)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
