"""aiohttp's and asyncio's client errors as vllama's upstream error tree (``errors.UpstreamError``):
the one mapping, so that handlers never see aiohttp's exception types.

:func:`raise_mapped` is the one helper every reader calls in its ``except`` (a streamed body's
per-token reads too: a ``try`` costs nothing until it raises, where a context manager per read would
cost its calls); :func:`mapped_errors` is the same for a block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import aiohttp

from vllama_proxy.errors import UpstreamError, UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable


def map_client_error(e: BaseException, where: str) -> UpstreamError | None:
    """Translate an aiohttp/asyncio client exception into the upstream error tree.

    Returns ``None`` for exceptions that are not about the upstream (e.g. cancellation),
    which the caller re-raises unchanged.
    """
    if isinstance(e, (aiohttp.ServerTimeoutError, asyncio.TimeoutError, TimeoutError)):
        return UpstreamTimeout(f"vLLM at {where} did not answer in time")
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamUnavailable(f"vLLM is not reachable at {where}: {e.os_error.strerror or e}")
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError, ConnectionError)):
        return UpstreamUnavailable(f"vLLM closed the connection before the answer was complete ({type(e).__name__})")
    if isinstance(e, aiohttp.ClientResponseError):
        return UpstreamProtocolError(f"vLLM sent an invalid HTTP answer: {e.message}")
    if isinstance(e, aiohttp.ClientError):
        return UpstreamUnavailable(f"vLLM request failed: {e}")
    return None


def never_sent(e: BaseException) -> bool:
    """Whether the upstream error ``e`` (mapped here) came before vLLM took the request: its connect failed."""
    return isinstance(e.__cause__, aiohttp.ClientConnectorError)


def raise_mapped(e: BaseException, where: str) -> NoReturn:
    """Raise ``e`` as the upstream error tree (:func:`map_client_error`, chained ``from e``); ``e`` itself
    when it is one already or is not about the upstream (cancellation, a generator being closed).

    Args:
        e: the exception caught.
        where: the server's origin, for the message (``http://127.0.0.1:8000``).
    """
    if isinstance(e, UpstreamError):
        raise e
    mapped = map_client_error(e, where)
    if mapped is None:
        raise e
    raise mapped from e


@contextmanager
def mapped_errors(where: str) -> Iterator[None]:
    """Re-raise aiohttp/asyncio client errors inside the block as the upstream error tree
    (:func:`raise_mapped`)."""
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - mapped or re-raised
        raise_mapped(e, where)
