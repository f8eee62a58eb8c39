"""Whether a running vLLM must restart for adapters created since it started, as a pure decider.

``models/adapters.py`` says what a plan is and whether a vLLM started with one serves another
(``LoraPlan.needs_restart``: in ``launch`` mode every adapter is declared at launch, in ``runtime``
mode only the LoRA limits count). Here: when. In ``launch`` mode the restart is due at once (busy or
not: the supervisor drains it); in ``runtime`` mode once vLLM is idle. The supervisor
(``lifecycle.py``) reads the created models when told (a create's ``ADAPTERS`` message) and acts.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllama_proxy.models.adapters import LoraPlan


@dataclass(frozen=True)
class LoraRestart:
    """``wanted``: the plan a restart is due for (kept until the restart; ``None``: none due);
    ``now``: restart now; ``waits``: it waits for vLLM's requests to end (log it, once per news)."""

    wanted: LoraPlan | None
    now: bool = False
    waits: bool = False


def lora_restart(running: LoraPlan, wanted: LoraPlan | None, *, read: bool, mode: str, in_use: bool) -> LoraRestart:
    """The decision at a look.

    Args:
        running: the plan vLLM started with.
        wanted: the plan the created models ask for, freshly read (``read``), else the one an
            earlier look kept (``None``: none due).
        read: the created models were read for this look (an adapter was created).
        mode: the adapter mode (``launch.lora_mode``).
        in_use: requests of vllama's are in flight or waiting.
    """
    if read and wanted is not None and not running.needs_restart(wanted, mode):
        wanted = None
    if wanted is None:
        return LoraRestart(None)
    if mode == "launch" or not in_use:
        return LoraRestart(wanted, now=True)
    return LoraRestart(wanted, waits=read)
