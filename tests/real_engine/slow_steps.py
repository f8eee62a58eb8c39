"""A vLLM logits processor that makes every engine step last at least ``VLLAMA_TEST_STEP_S`` seconds (default
0.02) and changes no logit: the tiny random model then makes its tokens at a large model's pace on a GPU, whatever
the machine's load, so a test can act while a stream is mid-way (``test_real_resume.py``).

Loaded by vLLM itself: ``vllm serve ... --logits-processors real_engine.slow_steps:SlowSteps`` with this folder's
parent on ``PYTHONPATH``. Not argmax-invariant, so vLLM applies it to greedy requests too (vLLM 0.32
``v1/sample/logits_processor/interface.py``). With ``VLLAMA_TEST_STEP_FILE`` set, a step lasts the seconds that
file holds while it exists and no longer than vLLM makes it otherwise (a shared server slowed for one test).
"""

from __future__ import annotations

import os
import time

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


class SlowSteps(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        self.step_s = float(os.environ.get("VLLAMA_TEST_STEP_S", "0.02"))
        self.step_file = os.environ.get("VLLAMA_TEST_STEP_FILE")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        step_s = self.step_s
        if self.step_file:
            try:
                with open(self.step_file) as f:
                    step_s = float(f.read())
            except (OSError, ValueError):
                step_s = 0.0
        if step_s > 0:
            time.sleep(step_s)
        return logits
