"""``vllama batch``: run an OpenAI-batch style JSONL file through a running vllama server.

::

    vllama batch requests.jsonl -o results.jsonl [--concurrency N] [--host URL] [--api-key KEY]
                 [--retries 5] [--retry-backoff 1.0] [--read-timeout 3600] [--restart | --retry-failed]

Invariant: every input line ends up exactly once in the output, across crashes and resumed runs: each
result is appended as one ``write`` when it finishes, a torn last line is truncated on start, lines
already answered are skipped. Input, output, retries, exit codes and the default concurrency (twice
the server's ``max_running``; why: ``docs/decisions.md``) are in ``docs/api.md`` "Batch jobs".
"""

from .cli import build_parser, main
from .errors import BatchError
from .progress import Summary
from .results import scan_output
from .run import run_batch
from .send import server_url

__all__ = ["BatchError", "Summary", "build_parser", "main", "run_batch", "scan_output", "server_url"]
