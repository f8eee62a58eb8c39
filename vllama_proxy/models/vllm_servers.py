"""The vLLM servers each model's requests go to: one server per model (and, when vllama runs it,
its status board), each reached through its HTTP client, and the models it serves.

A :class:`BackendSpec` is the picklable description of one server every proxy process receives;
:class:`Backend` is its live form in one process, whose HTTP client (``upstream.Upstream``)
shares that process's one connection pool with every other backend. :class:`ServedModel` is
one model a server lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllama_proxy.upstream import Upstream

from .boards import EngineBoard


@dataclass(frozen=True)
class ServedModel:
    """One entry of vLLM's ``/v1/models``.

    Attributes:
        name: vLLM's served name (the ``model`` sent upstream).
        root: the model path or hub id it was loaded from.
        max_model_len: context length in tokens, if vLLM reports it.
        created: seconds since the epoch.
        vllm_args: the ``vllm serve`` arguments it runs with (capabilities come from them).
    """

    name: str
    root: str
    max_model_len: int | None
    created: int
    vllm_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendSpec:
    """One vLLM server.

    Attributes:
        url: its base URL (no ``/v1``).
        board: its supervisor's status board when vllama runs it (``supervisor/status.py``'s
            ``StatusBoard``, handed in from ``front/``; typed by its protocol, ``boards.py``:
            ``models/`` stands below the supervisor and names nothing of it);
            ``None``: ``--upstream``.
        model: the model vllama launched there (``None``: whatever its ``/v1/models`` lists).
        slot: the on-demand slot it is (``supervisor/slots.py``; its model changes), else ``None``.
    """

    url: str
    board: EngineBoard | None = None
    model: ServedModel | None = None
    slot: int | None = None


class Backend:
    """A :class:`BackendSpec` in this process: ``upstream`` is its client, ``board`` its status."""

    def __init__(self, spec: BackendSpec, upstream: Upstream) -> None:
        self.upstream = upstream
        self.board = spec.board
        self.model = spec.model
        self.slot = spec.slot
