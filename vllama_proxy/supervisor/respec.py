"""An on-demand slot's model changed: what its supervisor runs from now on, as a pure decider.

A request claims a slot for a model (``slots.py``: the model's spec written to the slot, its
generation raised); the slot's supervisor reads the new model only while nothing of it runs
(``lifecycle.Supervisor``, before each step of the states where no vLLM runs). The spec is parsed
only when the generation moved: most looks read one integer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllama_proxy.models.launch_spec import ModelConfig


@dataclass(frozen=True)
class Respec:
    """The slot's model since ``generation``: ``spec``, prepared as configured models are."""

    generation: int
    spec: ModelConfig


def respec(seen: int, generation: int, read: Callable[[], ModelConfig | None],
           prepare: Callable[[ModelConfig], ModelConfig] | None = None) -> Respec | None:
    """The model to run from now on, ``None`` when it is the same (or the slot holds none).

    Args:
        seen: the slot's generation when its model was last taken over.
        generation: the slot's generation now (``SlotTable.generation``).
        read: the slot's spec (``SlotTable.spec``), called only when the generation moved.
        prepare: applied to the new spec (``sizing.with_api_servers``), as for configured models.
    """
    if generation == seen:
        return None
    spec = read()
    if spec is None:
        return None
    return Respec(generation, prepare(spec) if prepare is not None else spec)
