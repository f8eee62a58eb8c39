"""What runs on the client side: the ``vllama`` client commands and ``vllama batch``.

Invariant: they talk to a running server over HTTP only and import nothing of the server's side,
only this package and the package root's wire helpers (``tests/test_import_graph.py``), so ``vllama
list`` starts without pydantic-settings, structlog or aiohttp. ``main.py`` parses the command line
and maps failures to a line and an exit status; ``commands.py`` has the handlers; ``api_client.py``
is the blocking HTTP client; ``formatting.py`` prints as Ollama's CLI does; ``chat.py`` and
``repl.py`` are ``vllama run``; ``create.py``, ``launch.py`` and ``usage.py`` the commands so named;
``batch/`` is ``vllama batch``.
"""
