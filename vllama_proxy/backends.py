"""Where each model's requests go: one vLLM server (and, when vllama runs it, its status board) per model.

A :class:`BackendSpec` is the picklable description every proxy process receives;
:class:`Backend` is its live form in one process, whose upstream client shares that
process's one connection pool with every other backend.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalog import ServedModel
from .supervisor.status import StatusBoard
from .upstream import Upstream


@dataclass(frozen=True)
class BackendSpec:
    """One vLLM server.

    Attributes:
        url: its base URL (no ``/v1``).
        board: its supervisor's status when vllama runs it (``None``: ``--upstream``).
        model: the model vllama launched there (``None``: whatever its ``/v1/models`` lists).
    """

    url: str
    board: StatusBoard | None = None
    model: ServedModel | None = None


class Backend:
    """A :class:`BackendSpec` in this process: ``upstream`` is its client, ``board`` its status."""

    def __init__(self, spec: BackendSpec, upstream: Upstream) -> None:
        self.upstream = upstream
        self.board = spec.board
        self.model = spec.model
