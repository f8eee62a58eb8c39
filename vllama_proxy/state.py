"""Typed keys for the app-scoped objects every handler reaches through ``request.app``."""

from __future__ import annotations

from aiohttp import web

from .catalog import Catalog
from .settings import Settings
from .supervisor.status import StatusBoard
from .upstream import Upstream

SETTINGS = web.AppKey("settings", Settings)
UPSTREAM = web.AppKey("upstream", Upstream)
CATALOG = web.AppKey("catalog", Catalog)
STATUS = web.AppKey("status", StatusBoard)
