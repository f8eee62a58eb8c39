"""The app's state, by name: aiohttp's typed keys (``web.AppKey``) for the app-scoped objects every
handler reaches through ``request.app``, and the request keys (``request[...]``) the middlewares and
handlers share. (The clients' API keys are ``api/policy/keys.py``'s.)"""

from __future__ import annotations

from aiohttp import web

from vllama_proxy.models.blobs import BlobStore
from vllama_proxy.models.catalog import Catalog
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor.sizing import Plan

from .policy.keys import KeyRing
from .usage.ledger import Ledger
from .fleet.client_affinity import ClientAffinity
from .fleet.router_release import RouterRelease

SETTINGS = web.AppKey("settings", Settings)
#: The served models, and the backend (vLLM server, status board) of each.
CATALOG = web.AppKey("catalog", Catalog)
#: This process's index among ``--workers``: its slot in each board's in-flight counts.
WORKER = web.AppKey("worker", int)
#: How many processes each side of the front end runs, and why (``supervisor/sizing.py``).
FRONT_END = web.AppKey("front_end", Plan)
#: Request key: close the connection after this request's response (its body could not be read).
CLOSE_AFTER = "vllama.close_after"
#: Uploaded blobs (``/api/blobs``), which ``/api/create`` names by digest.
BLOBS = web.AppKey("blobs", BlobStore)
#: The API keys and their roles (``api/policy/keys.py``), read again on SIGHUP.
KEYS = web.AppKey("keys", KeyRing)
#: vLLM's running capacity over all models (requests it runs at once), ``None`` when unknown
#: (``--upstream`` without ``--max-running`` / ``--max-num-seqs``): ``/api/version``'s ``max_running``.
MAX_RUNNING = web.AppKey("max_running", object)
#: Whether the server is draining (``admission.AdmissionBound.draining``: shared by every worker): ``/readyz`` 503.
DRAINING = web.AppKey("draining", object)
#: Request key: ``time.perf_counter_ns()`` when the outermost middleware saw the request (stage timings).
ACCEPTED = "vllama.accepted"
#: The minted keys' store (``key_store.KeyStore``, in the usage database), ``None`` with ``--usage-db off``.
KEY_STORE = web.AppKey("key_store", object)
#: This process's usage ledger (``ledger.py``), ``None`` with ``--usage-db off``.
LEDGER = web.AppKey("ledger", Ledger)
#: The server-wide admission count (``admission.AdmissionBound``): requests in flight per key.
ADMISSION = web.AppKey("admission", object)
#: One-request session keys released at the router when their request ends (``api/fleet/router_release.py``).
ROUTER_RELEASE = web.AppKey("router_release", RouterRelease)
#: The clients' own session keys in flight, scoped to their caller and bounded (``api/fleet/client_affinity.py``).
CLIENT_AFFINITY = web.AppKey("client_affinity", ClientAffinity)
#: The settler (``settler.py``): charges each request once, at its end.
SETTLER = web.AppKey("settler", object)
