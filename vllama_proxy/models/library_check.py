"""What the packaged library table must get right beyond its schema, and the check a contributor runs.

    python -m vllama_proxy.models.library_check [FILE ...]

checks files as the loader does (the packaged table strictly: every row sourced, every parser
one vLLM registers) and prints what it found (docs/library.md). A user's file is held to the
schema alone; a parser vLLM did not register when the table was made is a warning for it
(:func:`unknown_parsers`, logged at start), not an error: a newer vLLM may have it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .library_schema import PACKAGED, LibraryError, LibraryFile, Model, read_file

# The parsers vLLM registers (vllm/tool_parsers/__init__.py, vllm/reasoning/__init__.py, vLLM
# main of August 2026). The packaged table must use these; a user's file may name others (a
# newer vLLM), which is logged, not refused: vLLM itself rejects a parser it lacks.
TOOL_PARSERS = frozenset({
    "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "cohere_command3", "cohere_command4",
    "ernie45", "glm45", "glm47", "granite-20b-fc", "granite", "granite4", "hermes", "poolside_v1",
    "hunyuan_a13b", "hy_v3", "internlm", "jamba", "lfm2", "kimi_k2", "kimi_k3", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "mimo", "minimax_m2", "minimax_m3", "minicpm5",
    "mistral", "olmo3", "openai", "phi4_mini_json", "pythonic", "qwen3_coder", "qwen3_xml",
    "seed_oss", "step3", "step3p5", "inkling", "xlam", "gigachat3", "functiongemma", "gemma4",
    "apertus", "solar_open2",
})
REASONING_PARSERS = frozenset({
    "deepseek_r1", "deepseek_v3", "deepseek_v4", "poolside_v1", "cohere_command3", "cohere_command4",
    "ernie45", "gemma4", "glm45", "glm47", "openai_gptoss", "granite", "holo2", "hunyuan_a13b", "hy_v3",
    "kimi_k2", "kimi_k3", "mimo", "minimax_m2", "minimax_m2_append_think", "minimax_m3", "mistral",
    "nemotron_v3", "olmo3", "qwen3", "seed_oss", "step3", "step3p5", "inkling", "solar_open2",
})


def strict_problems(doc: LibraryFile) -> tuple[list[str], list[str]]:
    """What the packaged table must also get right, beyond the schema: ``(errors, warnings)``.

    Errors: the top-level keys missing; a row without Ollama's library page among its
    sources; a parser vLLM does not register. Warnings: a tag's model card not among the sources.
    """
    errors: list[str] = []
    warnings: list[str] = []
    if doc.schema_version != 1 or doc.quant_classes is None:
        errors.append("top: schema_version = 1 and [quant_classes] are required")
    for m in doc.model:
        if f"https://ollama.com/library/{m.name}" not in m.sources:
            errors.append(f"{m.name}: sources lack https://ollama.com/library/{m.name}")
        errors += [f"{m.name}: {p}" for p in unknown_parsers(m)]
        for t in m.tag:
            if f"https://huggingface.co/{t.repo}" not in m.sources:
                warnings.append(f"{m.name}:{t.tag}: the model card https://huggingface.co/{t.repo} is not among the sources")
    return errors, warnings


def unknown_parsers(m: Model) -> list[str]:
    """The parsers ``m`` names that vLLM (as of the table's making) does not register."""
    out = []
    for t in (None, *m.tag):
        f = m.served_by(t)
        tool, reason = f.tool_call_parser, f.reasoning_parser
        if tool and tool not in TOOL_PARSERS:
            out.append(f"unknown tool_call_parser {tool!r}")
        if reason and reason not in REASONING_PARSERS:
            out.append(f"unknown reasoning_parser {reason!r}")
    return sorted(set(out))


def main(argv: list[str]) -> int:
    """Check library files (default: the packaged one, strictly); print one summary line per file."""
    status = 0
    for arg in argv or [str(PACKAGED)]:
        path = Path(arg)
        try:
            doc = read_file(path)
        except LibraryError as e:
            print(f"error: {e}")
            status = 1
            continue
        errors, warnings = strict_problems(doc) if path.resolve() == PACKAGED.resolve() else ([], [])
        for w in warnings:
            print(f"warning: {path}: {w}")
        for e in errors:
            print(f"error: {path}: {e}")
        tags = sum(len(m.tag) for m in doc.model)
        print(f"{path}: {len(doc.model)} names, {tags} tags, {len(errors)} errors, {len(warnings)} warnings")
        status |= bool(errors)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
