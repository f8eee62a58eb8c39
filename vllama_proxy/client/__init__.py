"""What runs on the client side: the ``vllama`` client commands and ``vllama batch``.

They talk to a running server over HTTP only and import nothing of the server's side, only
this package and the package root's wire helpers (``tests/test_import_graph.py``), so
``vllama list`` starts without pydantic-settings, structlog or aiohttp.

- ``main.py``: the command line (one argparse subparser per command, each naming its handler)
  and the mapping of what went wrong to a line on stderr and an exit status;
- ``commands.py``: one handler per command (``list``, ``ps``, ``show``, ``pull``, ``run``,
  ``stop``, ``cp``, ``rm``) and ``vllama -v``;
- ``api_client.py``: the blocking HTTP client of the Ollama API;
- ``formatting.py``: what they print, as Ollama's CLI prints it (tables, sizes, times, the
  spinner, the pull's progress bars, word wrapping);
- ``chat.py``: one turn of ``vllama run`` (load the model, stream an answer);
- ``repl.py``: the ``>>>`` session and its slash commands;
- ``batch.py``: ``vllama batch``, an OpenAI-batch JSONL file through a running server.
"""
