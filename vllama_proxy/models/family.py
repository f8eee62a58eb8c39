"""vLLM's tool and reasoning parsers for a local model, told from its own files.

A library name gets its parsers from ``library.toml``; a local model has no row, and without
``--tool-call-parser`` vLLM refuses tools and returns a ``<think>`` block as text. Its chat template
says which format it was trained on: the markers below are those each vLLM parser reads
(``vllm/tool_parsers/``, ``vllm/reasoning/``), covering every parser the library uses but
``phi4_mini_json`` and ``gemma4`` (no unique marker). Detection is a default (``detect_parsers``),
logged at start (``parsers_detected``); a parser given in the model's fields or ``vllm_args`` wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllama_proxy.logs import get_logger

from .launch_spec import ModelConfig, has_flag, pooling
from .model_files import ModelFiles, find_model_dir, read_model_files

log = get_logger("vllama.models")

#: (marker in the chat template, vLLM --tool-call-parser), first match wins: the more specific first.
_TOOL_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "openai"),                    # gpt-oss (harmony)
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),  # DeepSeek V3 / R1-0528
    ("<function=", "qwen3_coder"),                # Qwen3-Coder's XML calls inside <tool_call>
    ("<|tool_call|>", "granite"),                 # Granite 3.x
    ("[TOOL_CALLS]", "mistral"),                  # Mistral
    ("<|python_start|>", "llama4_pythonic"),      # Llama 4
    ("<tool_call>", "hermes"),                    # Qwen2.5 / Qwen3 / Hermes, Granite 4
    ("<|python_tag|>", "llama3_json"),            # Llama 3.1-3.3
)
#: (marker, vLLM --reasoning-parser), first match wins.
_REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "openai_gptoss"),
    ("[THINK]", "mistral"),
    ("<｜Assistant｜><think>", "deepseek_r1"),  # R1 and its distills: the prompt opens the block
    ("<think>", "qwen3"),                         # Qwen3 and templates that write or strip <think>
    ("enable_thinking", "qwen3"),
)


@dataclass(frozen=True)
class Parsers:
    """What the files say: ``tool_call_parser`` / ``reasoning_parser`` (``None``: none told) and why."""

    tool_call_parser: str | None
    reasoning_parser: str | None
    reason: str


def detect_parsers(files: ModelFiles) -> Parsers:
    """The parsers ``files``' chat template was written for (see the module docstring).

    Granite 4 writes ``<tool_call>`` as Hermes does but vLLM reads it with ``granite4``: told apart by
    ``config.json``'s ``model_type``. A model without a chat template gets none.
    """
    template = files.chat_template or ""
    if not template:
        return Parsers(None, None, "no chat template")
    tool = next((parser for marker, parser in _TOOL_MARKERS if marker in template), None)
    if tool == "hermes" and files.architecture.startswith("granite"):
        tool = "granite4"
    reasoning = next((parser for marker, parser in _REASONING_MARKERS if marker in template), None)
    found = [f"{kind} {p}" for kind, p in (("tools", tool), ("thinking", reasoning)) if p]
    reason = (f"chat template of a {files.architecture} model: " + ", ".join(found)) if found else "no tool or thinking markers in the chat template"
    return Parsers(tool, reasoning, reason)


def with_detected_parsers(spec: ModelConfig) -> ModelConfig:
    """``spec`` with the parsers its files tell (:func:`detect_parsers`) where it gives none itself:
    a ``tool_call_parser``/``reasoning_parser`` field or its flag in ``vllm_args`` wins, and so does
    ``--enable-auto-tool-choice`` given alone. A pooling model, or one whose files are not on this
    machine, comes back as it is. Reads the model's files (blocking): at start-up, or in a thread."""
    args = spec.vllm_args
    wants_tool = spec.tool_call_parser is None and not has_flag(args, "--tool-call-parser") and not has_flag(args, "--enable-auto-tool-choice")
    wants_reasoning = spec.reasoning_parser is None and not has_flag(args, "--reasoning-parser")
    if not (wants_tool or wants_reasoning) or pooling(args) or find_model_dir(spec.model) is None:
        return spec
    found = detect_parsers(read_model_files(spec.model, spec.served_name))
    update = {}
    if wants_tool and found.tool_call_parser:
        update["tool_call_parser"] = found.tool_call_parser
    if wants_reasoning and found.reasoning_parser:
        update["reasoning_parser"] = found.reasoning_parser
    log.info("parsers_detected" if update else "parsers_not_detected", model=spec.served_name, reason=found.reason,
             **update, override="give --tool-call-parser/--reasoning-parser (or the model's fields) to choose others")
    return spec.model_copy(update=update) if update else spec
