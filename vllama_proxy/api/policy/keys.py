"""The clients' API keys with roles: who may do what, and whose share a request counts in.

Keys come from ``--api-key`` (admin keys), ``--api-key-file`` (one key a line, or TOML ``[[keys]]`` tables,
:class:`KeyEntry`, whose fields but the secret are :class:`KeySettings`) and the minted keys of
``key_store.py``; :class:`KeyRing` holds them all. Roles: **user** (its models), **admin** (also models and
the server), **metrics**. Which role reaches which route is ``route_roles.py``'s one table, checked by
:func:`middleware` before anything else runs (a route not in it is 404, never relayed); a handler reads the
caller with :func:`key_of`. Invariants: a key is found by the SHA-256 of what the client sends (one hash, one
dict lookup, no early-exit comparison; a minted key's expiry in the same lookup); ``SIGHUP`` rereads the file
in every worker, and one that no longer parses leaves the keys as they were; with no key every caller is an
admin, as in Ollama. The keys file: ``docs/configuration.md`` "Many users"; why SHA-256: ``docs/decisions.md``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import fnmatch
import hashlib
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from vllama_proxy.errors import Forbidden, Unauthorized
from vllama_proxy.logs import get_logger
from . import cache_salt
from .route_roles import ADMIN, WHAT, Route, methods_of, route_of

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

log = get_logger("vllama.keys")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Request key: the :class:`Key` a request came with (absent: none was found; ``/readyz`` and ``/admin`` ask).
KEY = "vllama.key"
#: Request key: the :class:`Key` a request is served as, :data:`OPEN` when it came with none, set for every
#: request the key check lets through: what :func:`key_of` reads. A request is asked ~9 times for its key;
#: on an open server each read of the absent :data:`KEY` raised a ``KeyError`` inside ``Mapping.get`` (~1 µs
#: each).
SERVED_AS = "vllama.served_as"
#: Per-key counters in shared memory (``admission.py``): a key's slot is a hash of its name.
KEY_COUNTERS = 1024


#: What a key's name may be made of (the keys file's and a minted key's alike).
NAME_PATTERN = r"^[A-Za-z0-9._@:-]+$"


class KeySettings(BaseModel):
    """Everything a key can be given: its name, role, models, limits, end-user settings, expiry and note. The one
    definition of these fields for both sources of keys: the keys file's ``[[keys]]`` tables (:class:`KeyEntry` adds
    the secret) and the keys minted through ``/api/keys`` and the ``/admin`` page (``key_store.py`` keeps them,
    ``routes/keys.py`` takes them), so a minted key can be whatever a file key can. The meanings: :class:`Key`'s
    attributes; ``docs/configuration.md`` "The keys file"."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=NAME_PATTERN)
    role: Literal["admin", "user", "metrics"] = "user"
    models: list[str] = Field(default_factory=list, max_length=256)
    max_in_flight: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=-1000, le=1000)
    weight: float = Field(1.0, gt=0, le=1000)
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    budget_tokens: int | None = Field(None, ge=0)
    budget_period: Literal["day", "month"] = "month"
    trusted_front: bool = False
    user_header: str = Field("X-OpenWebUI-User-Id", max_length=128, pattern=r"^[A-Za-z0-9-]*$")
    user_body: bool = True
    user_max_in_flight: int | None = Field(None, ge=1)
    user_rpm: int | None = Field(None, ge=1)
    user_tpm: int | None = Field(None, ge=1)
    user_budget_tokens: int | None = Field(None, ge=0)
    hash_end_users: bool = False
    #: when it stops working (RFC 3339, a TOML date-time or seconds since the epoch; one without a zone is UTC)
    expires_at: dt.datetime | None = None
    note: str = Field("", max_length=500)

    @field_validator("expires_at")
    @classmethod
    def _utc(cls, v: dt.datetime | None) -> dt.datetime | None:
        return v.replace(tzinfo=dt.timezone.utc) if v is not None and v.tzinfo is None else v

    def to_key(self, source: str = "file") -> Key:
        """The :class:`Key` the request path sees (no secret: :class:`KeyRing` indexes it by its digest)."""
        same = self.model_dump(include=KEY_FIELDS - {"models", "expires_at"})
        return Key(**same, models=tuple(self.models), expires_at=self.expires_at.timestamp() if self.expires_at else None,
                   source=source)


class KeyEntry(KeySettings):
    """One ``[[keys]]`` table of the keys file: :class:`KeySettings` and the secret (``key``, or its ``sha256``)."""

    key: SecretStr | None = None
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")

    @model_validator(mode="after")
    def _one_secret(self) -> KeyEntry:
        if (self.key is None) == (self.sha256 is None):
            raise ValueError(f"key '{self.name}': give exactly one of key or sha256")
        return self


@dataclass(frozen=True)
class Key:
    """A known key, as the request path sees it (never its secret).

    Attributes:
        name: its name (logs, metrics, the per-key counter).
        role: ``admin``, ``user`` or ``metrics`` (``route_roles.py``: what each may reach).
        models: names or shell patterns it may use (empty: every model).
        max_in_flight: its own bound on requests in flight (``None``: only its fair share).
        max_tokens: most tokens one answer may generate, in tokens (``None``: the model's context).
        priority: higher is served first.
        weight: its weight in the fair queue (``fair_queue.py``: its token counter grows by cost / weight).
        rpm, tpm: requests and tokens per minute (``rate_limits.py``; ``None``: no limit).
        counter: its per-key counter's index (:data:`KEY_COUNTERS`).
        budget_tokens: prompt + output tokens it may use per ``budget_period`` (``None``: no budget;
            ``api/policy/budgets.py`` checks it against the usage ledger).
        budget_period: ``day`` or ``month`` (UTC).
        expires_at: seconds since the epoch after which it is refused (``None``: never; minted keys only).
        source: ``file`` (``--api-key``, ``--api-key-file``: read-only to the admin API) or ``api`` (minted:
            ``key_store.py``).
        cache_salt: the ``cache_salt`` its requests carry to vLLM, its own share of the prefix cache
            (``cache_salt.of_key``, computed once when the keys are read); ``None`` with ``--cache-isolation
            off`` and for :data:`OPEN`.
        trusted_front: its requests name their end user (``end_users.py``): a sub-tenant of the key in the
            fair queue, the per-user limits, the ledger and the access log. Any other key's naming is ignored.
        user_header: the header a trusted front names the end user in (``""``: none).
        user_body: whether a trusted front's body may name it (OpenAI ``user``/``safety_identifier``,
            Anthropic ``metadata.user_id``), read when the header is absent.
        user_max_in_flight, user_rpm, user_tpm, user_budget_tokens: each end user's own limits (``None``: none).
        hash_end_users: the access log shows the end user hashed (``end_users.log_name``).
        note: the operator's note (the admin API's list and the page show it).
    """

    name: str
    role: str = "admin"
    models: tuple[str, ...] = ()
    max_in_flight: int | None = None
    priority: int = 0
    weight: float = 1.0
    rpm: int | None = None
    tpm: int | None = None
    counter: int = 0
    max_tokens: int | None = None
    budget_tokens: int | None = None
    budget_period: str = "month"
    expires_at: float | None = None
    source: str = "file"
    cache_salt: str | None = field(default=None, compare=False, repr=False)
    trusted_front: bool = False
    user_header: str = ""
    user_body: bool = True
    user_max_in_flight: int | None = None
    user_rpm: int | None = None
    user_tpm: int | None = None
    user_budget_tokens: int | None = None
    hash_end_users: bool = False
    note: str = field(default="", compare=False)
    user_hash_key: bytes = field(default=b"", compare=False, repr=False)
    _cache: dict[str, bool] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def may_use(self, *names: str) -> bool:
        """Whether one of ``names`` (as asked, served name, repo; any case, ``:latest`` ignored)
        matches its ``models`` patterns; always true without patterns."""
        if not self.models:
            return True
        for name in names:
            folded = name.casefold().removesuffix(":latest")
            ok = self._cache.get(folded)
            if ok is None:
                ok = any(fnmatch.fnmatchcase(folded, p.casefold().removesuffix(":latest")) for p in self.models)
                if len(self._cache) < 4096:
                    self._cache[folded] = ok
            if ok:
                return True
        return False


#: The :class:`Key` attributes that are :class:`KeySettings` fields (the rest: what :class:`KeyRing` derives).
KEY_FIELDS = frozenset(f.name for f in dataclasses.fields(Key)) & frozenset(KeySettings.model_fields)


def settings_of_row(row: dict) -> KeySettings:
    """A minted key's :class:`KeySettings` from its stored row (``key_store.KeyStore.rows``: ``name``, ``spec``,
    ``expires_at`` in seconds, ``note``); a field the row was stored without gets its default."""
    return KeySettings.model_validate({**row["spec"], "name": row["name"], "expires_at": row["expires_at"], "note": row["note"]})


#: The caller of a server with no key configured: open, an admin (as Ollama, which has no keys).
OPEN = Key(name="-", role="admin")


def counter_of(name: str, taken: set[int]) -> int:
    """A stable counter slot for ``name``: CRC-32 of the name, the next free one on a collision; once every slot
    is taken (more keys than :data:`KEY_COUNTERS`), the hashed one, shared with the key already there: two keys
    sharing counters count their requests and tokens together, so their limits only hold tighter."""
    first = i = zlib.crc32(name.encode()) % KEY_COUNTERS
    while i in taken:
        i = (i + 1) % KEY_COUNTERS
        if i == first:
            return first
    return i


def parse_keys_file(path: Path) -> list[tuple[str, Key]]:
    """``(sha256 hex, Key)`` for each key of ``path`` (see the module docstring for both formats).

    Raises:
        OSError: it cannot be read.
        ValueError: a TOML file whose ``[[keys]]`` are malformed (the message names the entry and field).
    """
    text = path.read_text()
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        doc = None
    if doc is None or "keys" not in doc:  # one key a line: each an admin key
        if path.suffix == ".toml" and doc is None:
            tomllib.loads(text)  # a .toml file that does not parse: say where
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        return [(hashlib.sha256(ln.encode()).hexdigest(), Key(name=f"{path.name}:{i + 1}")) for i, ln in enumerate(lines)]
    entries = doc.get("keys")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: 'keys' must be an array of tables ([[keys]])")
    out: list[tuple[str, Key]] = []
    names: set[str] = set()
    for n, raw in enumerate(entries, 1):
        try:
            e = KeyEntry.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "entry"
            raise ValueError(f"{path}: [[keys]] #{n}: {where}: {first['msg']}") from None
        if e.name in names:
            raise ValueError(f"{path}: [[keys]] #{n}: the name '{e.name}' is given twice")
        names.add(e.name)
        digest = e.sha256.lower() if e.sha256 else hashlib.sha256(e.key.get_secret_value().encode()).hexdigest()  # type: ignore[union-attr]
        out.append((digest, e.to_key("file")))
    return out


class KeyRing:
    """Every configured key, found by the SHA-256 of what a client sends.

    Args:
        api_keys: ``--api-key`` values (admin keys, named ``api-key:1``...).
        path: ``--api-key-file`` (``None``: none).
        cache_isolation: ``--cache-isolation``: ``key`` gives each key its prefix-cache salt
            (``Key.cache_salt``), ``off`` none.
    """

    def __init__(self, api_keys: Iterable[str], path: Path | None, *, cache_isolation: str = "key") -> None:
        self._flag_keys = [k for k in api_keys if k]
        self.path = path
        self.cache_isolation = cache_isolation
        self._by_digest: dict[str, Key] = {}
        self._file: list[tuple[str, Key]] = []
        self._minted: list[tuple[str, Key]] = []
        self.load()

    @property
    def configured(self) -> bool:
        """Whether any key is configured (else the server is open)."""
        return bool(self._by_digest)

    @property
    def keys(self) -> list[Key]:
        return list(self._by_digest.values())

    def named(self, name: str) -> tuple[str, Key] | None:
        """``(sha256 hex of its secret, Key)`` of the key called ``name``, or ``None`` (the admin
        page's cookie is signed with the digest: ``routes/admin.py``)."""
        for digest, key in self._by_digest.items():
            if key.name == name:
                return None if key.expires_at is not None and key.expires_at <= time.time() else (digest, key)
        return None

    def find(self, token: bytes) -> Key | None:
        """The key whose secret is ``token``, or ``None`` (also for a minted key past its ``expires_at``): the one
        place a request's key is checked, the keys file's and the minted ones (``key_store.py``) alike."""
        key = self._by_digest.get(hashlib.sha256(token).hexdigest())
        if key is not None and key.expires_at is not None and key.expires_at <= time.time():
            return None
        return key

    def file_names(self) -> set[str]:
        """The names of the keys from ``--api-key`` and the keys file (the admin API may not take them)."""
        return {k.name for _, k in self._file}

    def set_minted(self, rows: list[dict]) -> None:
        """Take the minted keys (``KeyStore.rows()``: revoked ones are left out) beside the file's; a minted key
        whose name the file also gives is left out (the file's wins)."""
        names = self.file_names()
        minted = []
        for r in rows:
            if r["revoked_at"] is not None or r["name"] in names:
                continue
            minted.append((r["sha256"], settings_of_row(r).to_key("api")))
        before = {k.name for k in self._by_digest.values() if k.source == "api"}
        self._minted = minted
        self._index()
        after = {k.name for _, k in minted}
        if before != after:
            log.info("keys_minted_loaded", keys=sorted(after))

    def load(self) -> None:
        """Read the keys (at start; a bad file then stops the start: exit status 2).

        Raises:
            OSError, ValueError: as :func:`parse_keys_file`.
        """
        found = [(hashlib.sha256(k.encode()).hexdigest(), Key(name=f"api-key:{i + 1}")) for i, k in enumerate(self._flag_keys)]
        if self.path is not None:
            found += parse_keys_file(self.path)
        self._file = found
        self._index()

    def _index(self) -> None:
        """Index the file's and the minted keys by digest; each gets its counter slot (by name: the same in every
        worker that sees the same keys) and its cache salt."""
        taken: set[int] = set()
        by_digest: dict[str, Key] = {}
        file_names = {k.name for _, k in self._file}
        found = self._file + [(d, k) for d, k in self._minted if k.name not in file_names]
        for digest, key in sorted(found, key=lambda x: x[1].name):
            s = counter_of(key.name, taken)
            taken.add(s)
            salt = cache_salt.of_key(key.name, digest) if self.cache_isolation == "key" else None
            users = hashlib.blake2b(key.name.encode(), key=bytes.fromhex(digest), digest_size=32,
                                    person=b"vllama-user").digest()  # end_users.log_name's key: secret-derived
            by_digest[digest] = dataclasses.replace(key, counter=s, cache_salt=salt, user_hash_key=users, _cache={})
        self._by_digest = by_digest
        if len(by_digest) > KEY_COUNTERS:
            log.warning("keys_share_counters", keys=len(by_digest), counters=KEY_COUNTERS,
                        effect="keys beyond the counters' number share one with another key: their in-flight, rpm/tpm, "
                               "budget reservations and fair share count together")

    def reload(self) -> bool:
        """Read the keys again (``SIGHUP``); a file that cannot be read or parsed keeps the old keys.
        Requests in flight keep the key they came with. Whether the new keys took effect."""
        before, before_file = self._by_digest, self._file
        try:
            self.load()
            if before and not self._by_digest:
                raise ValueError("it holds no key any more (the server would be open to anyone)")
        except (OSError, ValueError) as e:
            self._by_digest, self._file = before, before_file
            log.error("keys_reload_failed", path=str(self.path), error=str(e), kept=len(before))
            return False
        log.info("keys_loaded", path=str(self.path), keys=sorted(k.name for k in self.keys),
                 admins=sum(k.admin for k in self.keys))
        return True


def key_of(request: web.Request) -> Key:
    """The key ``request`` came with (:data:`OPEN` on an open server or a route no key guards)."""
    return request.get(SERVED_AS, OPEN)


def _refusal(key: Key, route: Route, method: str) -> Forbidden:
    """The 403 for ``key`` on a route its role may not reach, naming what it may not do."""
    what = WHAT.get(route.path or "", f"call {method} {route.path}")
    needs = "an admin key" if route.roles == ADMIN else f"a key of role {' or '.join(sorted(route.roles or ()))}"
    return Forbidden(f"key '{key.name}' (role {key.role}) may not {what}: that needs {needs}")


def middleware(ring: KeyRing, metrics_open: bool = False) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Decide every request by ``route_roles.ROUTES`` before anything else runs: a route not listed
    is 404 (never relayed, whatever the key); a listed one needs ``Authorization: Bearer <key>``
    (or Anthropic's ``x-api-key: <key>`` on ``/v1/messages*``) unless it is open (the probes; the
    metrics routes with ``metrics_open``): 401 without a known key, 403 when the key's role may not
    reach it. ``/readyz`` takes a key when one is sent (its details are for key holders). With no
    key configured every caller is an admin."""

    @web.middleware
    async def keys(request: web.Request, handler: Handler) -> web.StreamResponse:
        # (CORS preflights were answered before, access.py: any other OPTIONS is decided like the rest)
        request[SERVED_AS] = OPEN
        route = route_of(request.method, request.path, metrics_open=metrics_open)
        if route.roles is None:
            if not route.known_path:
                raise web.HTTPNotFound()  # not in the table: answered here, never relayed
            if request.path.startswith("/v1/"):  # a relayed path's other method: answered here too
                raise web.HTTPMethodNotAllowed(request.method, methods_of(request.path))
        if not ring.configured:
            return await handler(request)  # open server: everyone is OPEN (an admin)
        needed = route.roles is None or bool(route.roles)  # a listed path's other method: a key, then 405
        if not (needed or "Authorization" in request.headers):
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if not scheme and request.path.startswith("/v1/messages"):  # Anthropic's own header (its SDK, Claude Code's ANTHROPIC_API_KEY)
            scheme, token = "bearer", request.headers.get("x-api-key", "")
        # headers arrive decoded with surrogateescape: encode back to the bytes sent
        key = ring.find(token.strip().encode("utf-8", "surrogateescape")) if scheme.lower() == "bearer" else None
        if key is None:
            if not needed:
                return await handler(request)  # a probe with a wrong key: still a probe
            raise Unauthorized("unauthorized: send Authorization: Bearer <api key>")
        request[KEY] = request[SERVED_AS] = key
        if route.roles and key.role not in route.roles:
            raise _refusal(key, route, request.method)
        return await handler(request)

    return keys
