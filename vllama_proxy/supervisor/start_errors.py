"""Why a start of vLLM can never succeed, read from the last lines the child printed before it exited.

Two kinds, both deterministic, so a restart only repeats them (each repeat a minute of loading on a
GPU host): vLLM's argparse refusing its command line, and the model's weights that cannot be had (the
Hugging Face hub's errors for a repository that is not there, gated, or a revision or file missing; a
model neither cached nor reachable, offline or with no network; a local path that is no model; vLLM's
pydantic check of its configuration). Any other exit is a crash, and is retried. The supervisor fails
such a start at once with vLLM's own words (``lifecycle.py``: ``Misconfigured``).
"""

from __future__ import annotations

import re

#: huggingface_hub's errors that no retry fixes (``huggingface_hub/errors.py``): ``LocalEntryNotFoundError`` is
#: what vLLM's ``snapshot_download`` raises for a model not cached when the hub cannot be reached (offline or no network).
_HUB = {"LocalEntryNotFoundError", "RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError",
        "EntryNotFoundError", "HFValidationError"}
#: ``OSError`` texts of transformers and vLLM for a model that is not there.
_NOT_THERE = ("is not a local folder and is not a valid model identifier", "couldn't connect to 'https://huggingface.co'",
              "does not appear to have a file named", "Invalid repository ID or local directory specified")
#: The last line of a traceback: ``[package.]Name: message``, after vLLM's ``(APIServer pid=N)`` prefix if any.
_RAISED = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): (.+)$")


def usage_error(returncode: int, lines: list[str]) -> str | None:
    """vLLM's message when it exited because it rejected its command line, else ``None``.

    vLLM parses ``vllm serve``'s arguments with argparse, which prints ``usage: vllm serve
    ...`` and ``vllm serve: error: <why>`` and exits with status 2.
    """
    if returncode != 2:
        return None
    errors = [line.strip() for line in lines if ": error: " in line]
    if not errors or not any(line.lstrip().startswith("usage:") for line in lines):
        return None
    return errors[-1]


def start_error(returncode: int, lines: list[str]) -> str | None:
    """One line saying why vLLM can never start as configured, in vLLM's own words, else ``None`` (a crash).

    Args:
        returncode: the child's exit status.
        lines: its last output lines, oldest first (``VllmProcess.last_lines``).

    Returns:
        ``"vLLM rejected its arguments: vllm serve: error: ..."``, ``"vLLM cannot load the model:
        LocalEntryNotFoundError: ..."`` and the like; ``None`` for any other exit.
    """
    usage = usage_error(returncode, lines)
    if usage is not None:
        return f"vLLM rejected its arguments: {usage}"
    if returncode == 0:
        return None
    for i in range(len(lines) - 1, -1, -1):
        raised = _RAISED.match(lines[i].strip())
        if raised is None:
            continue
        name, message = raised.groups()
        if name in _HUB or (name == "OSError" and any(t in message for t in _NOT_THERE)):
            return f"vLLM cannot load the model: {name}: {message}"
        if name == "ValidationError" and "pydantic" in lines[i]:  # "1 validation error for X", the error on the next line
            detail = lines[i + 1].strip().split(" [type=")[0] if i + 1 < len(lines) else message
            return f"vLLM refused its configuration: {message}: {detail}"
        return None  # the last exception raised decides: anything else is a crash
    return None
