"""The one client of vLLM's OpenAI-compatible server: a shared pool, errors mapped at this boundary.

``pool.py`` holds the connections of a process (sessions, connector, the bounded and retried
connects, the retry of a request whose pooled connection closed before its answer began);
``client.py`` the client of one server on that pool (``Upstream``; ``Upstream.at`` another server on
the same pool); ``body.py`` reads answers (whole, streamed, server-sent events); ``mapping.py`` turns
aiohttp's errors into ``errors.UpstreamError``'s tree, in one place.
"""

from .body import BodyWatch, SSEDecoder, encode_json, iter_sse, read_json, read_raw, read_response, read_some
from .client import Upstream
from .mapping import map_client_error, mapped_errors, never_sent, raise_mapped
from .pool import CONNECT_CONCURRENCY, CONNECT_TRY_S, CONTROL_CONNECTIONS, Pool, idle_lifetime

__all__ = ["CONNECT_CONCURRENCY", "CONNECT_TRY_S", "CONTROL_CONNECTIONS", "BodyWatch", "Pool", "SSEDecoder", "Upstream",
           "encode_json", "idle_lifetime", "iter_sse", "map_client_error", "mapped_errors", "never_sent", "raise_mapped", "read_json",
           "read_raw", "read_response", "read_some"]
