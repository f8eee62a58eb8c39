"""``vllama batch``: run an OpenAI-batch style JSONL file through a running vllama server.

::

    vllama batch requests.jsonl -o results.jsonl [--concurrency N] [--host URL] [--api-key KEY]
                 [--retries 5] [--retry-backoff 1.0] [--read-timeout 3600] [--restart | --retry-failed]

Input
-----
One JSON object per line, OpenAI Batch API format::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "...", ...}}

``url`` is one of ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` (OpenAI
surface, passed to vLLM) or ``/api/chat``, ``/api/generate``, ``/api/embed`` (Ollama surface).
Generation requests are sent with ``"stream": false`` (and without ``stream_options``)
whatever the line says. ``method``, when present, must be ``POST``. Blank lines are ignored
and not counted. ``custom_id`` must be a non-empty string, unique in the file.

An invalid line (not JSON, not an object, no ``custom_id``, unsupported ``url``, ``body`` not
an object, a ``custom_id`` already used by an earlier line) is not sent: it gets an error
result with code ``invalid_line``. A repeated ``custom_id`` is written as ``null`` there (the
message names it), so every ``custom_id`` occurs exactly once in the output.

Output
------
One line per input line, in completion order, OpenAI Batch output format::

    {"id": "batch_req_<n>", "custom_id": "q1", "response": {"status_code": 200, "body": {...}}, "error": null}

``<n>`` is the 1-based input line number, so ids are stable across resumed runs. A
non-2xx answer keeps ``response`` (status and the server's body) and adds
``"error": {"message": ..., "code": "http_error"}``. Requests that got no answer have
``"response": null`` and ``code`` ``connection_error`` (retries exhausted) or ``timeout``
(no byte for ``--read-timeout`` s); a 2xx answer that is not JSON is ``invalid_response``.

Retries: 503 (``server busy`` beyond ``--max-queue``, or a model still loading) and 429
are retried after ``Retry-After`` (at least) or an exponential backoff
(``--retry-backoff`` s doubling, capped at 60 s, with jitter), and so are connection
failures (refused, reset, connect timeout), at most ``--retries`` times. Any other status
is a final result: a 4xx is the request's own fault and would fail again.

Writing and resuming
--------------------
Each result is appended as one ``write`` of the whole line (``O_APPEND``, no user-space
buffer) the moment its request finishes; the file is fsynced at most every 0.5 s and at
exit. On start, when the output exists, its complete lines are read and the input lines
already answered there are skipped (matched by ``custom_id``; lines without a usable
``custom_id`` by ``id``, i.e. line number). A trailing partial line (a crash mid-write,
a power loss) is truncated away first; a complete line that is not JSON stops the run
(fix the file or use ``--restart``). Requests in flight when the run was stopped have no
line and are sent again, so the final output has every input line exactly once.
``--restart`` empties the output first; ``--retry-failed`` removes results that failed
for a transient reason (no response, 5xx, 429) from it and sends those lines again.

Exit codes: 0 when every input line has a result (error results included), 1 on usage
errors (bad flags, unreadable input, corrupt output, server unreachable or refusing the
API key) and unexpected failures (disk full), 130 on SIGINT / 143 on SIGTERM after
writing and syncing what finished (in-flight requests are cancelled; resume redoes them).

Concurrency
-----------
Without ``--concurrency`` the run keeps the server's running capacity busy: vllama's
``GET /api/version`` says how many requests vLLM runs at once (``max_running``: each
model's ``--max-num-seqs`` x data-parallel size), and the batch keeps twice that many in
flight (``concurrency.QUEUE_FACTOR``), so vLLM's waiting queue is as deep as its running
batch, as offline ``LLM.generate`` keeps it: when a wave of requests of one length ends,
every freed slot is refilled from vLLM's own queue, not after a round trip through the
client (a lone client at 64 in flight streamed 0.78x of vLLM's offline ``LLM.generate`` on
an H100; a quarter more than ``max_running`` was an earlier choice). A
server that does not say (another Ollama-API server, ``vllama serve --upstream`` without
``--max-running``) gets ``FALLBACK_CONCURRENCY``. The choice is printed. The open-file
limit is raised to its hard limit when the connections need it.

Progress goes to stderr: on a terminal a tqdm bar (done/total, ok, errors, output tokens/s,
requests/s, ETA), otherwise a log line every 5 s: done/total, ok/errors, requests/s, output
tokens/s (``usage.completion_tokens`` or Ollama's ``eval_count``), ETA.
"""

from .cli import build_parser, main
from .errors import BatchError
from .progress import Summary
from .results import scan_output
from .run import run_batch
from .send import server_url

__all__ = ["BatchError", "Summary", "build_parser", "main", "run_batch", "scan_output", "server_url"]
