"""A client that leaves mid-answer is a cancellation (499), not an internal error.

Under issue 38's flood on the H200 (1,000 streams ending at once), aiohttp raised
``ClientConnectionResetError`` ("Cannot write to closing transport") from a stream's write before the
handler's cancellation arrived, and the error middleware logged each as an unhandled 500 with its
traceback (154 in three rounds). The race needs a loaded loop to happen on its own, so the middleware
is driven here with the handler's own exception and a transport that is closing, as aiohttp leaves it.
"""

from __future__ import annotations

from unittest import mock

import pytest
from aiohttp import ClientConnectionResetError, web
from aiohttp.test_utils import make_mocked_request
from structlog.testing import capture_logs

from vllama_proxy.api.app import errors_and_access_log
from vllama_proxy.api.app_state import SETTINGS
from vllama_proxy.settings import Settings


def _request(closing: bool) -> web.Request:
    app = web.Application()
    app[SETTINGS] = Settings(upstream="http://127.0.0.1:1")
    transport = mock.Mock()
    transport.is_closing.return_value = closing
    return make_mocked_request("POST", "/api/generate", app=app, transport=transport)


async def _writes_to_a_gone_client(request: web.Request) -> web.StreamResponse:
    raise ClientConnectionResetError("Cannot write to closing transport")


async def test_a_write_to_a_client_that_left_is_a_cancellation_not_an_error():
    request = _request(closing=True)
    with capture_logs() as logs, pytest.raises(ConnectionResetError):
        await errors_and_access_log(request, _writes_to_a_gone_client)  # aiohttp drops it quietly
    assert not [e for e in logs if e["event"] == "unhandled_error"]
    assert [e["status"] for e in logs if e["event"] == "request"] == [499]


async def test_a_reset_while_the_client_is_still_there_is_still_an_error():
    request = _request(closing=False)
    with capture_logs() as logs:
        resp = await errors_and_access_log(request, _writes_to_a_gone_client)
    assert resp.status == 500
    assert [e for e in logs if e["event"] == "unhandled_error"]
