"""What Ollama 0.33's Modelfile commands ``DRAFT``, ``REQUIRES``, ``RENDERER`` and ``PARSER`` mean for a model vLLM serves.

- ``DRAFT`` (a directory, a repo id, or ``ngram``) with ``PARAMETER draft_num_predict N`` is vLLM's
  ``--speculative-config`` (``vllm/config/speculative.py``), a launch option: the base's vLLM
  restarts with it (:func:`speculative_json`, carried by ``adapters.py``'s ``LoraPlan``). The base
  checks every drafted token, so its answers and its other names are unchanged; one draft per base.
- ``REQUIRES`` is checked against :data:`OLLAMA_API_LEVEL` (``/api/version``).
- ``PARSER`` (Ollama's ``model/parsers/parsers.go``) is accepted when it matches the base's
  ``--tool-call-parser`` / ``--reasoning-parser``; ``RENDERER`` (``model/renderers/renderer.go``) when
  the model's Jinja template is of its family (``family.py``). Otherwise a 400 that says why
  (:data:`OLLAMA_PARSERS`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from vllama_proxy.errors import BadRequest
from .family import detect_parsers
from .launch_spec import vllm_arg
from .model_files import ModelFiles

#: The level of Ollama's API vllama speaks (``/api/version``; ``REQUIRES`` is checked against it): the
#: fields and routes of Ollama 0.33 (docs/api.md "Contract").
OLLAMA_API_LEVEL = "0.33.0"

#: ``draft_num_predict`` when a Modelfile gives none: Ollama's default (``api/types.go`` DefaultOptions).
DEFAULT_DRAFT_TOKENS = 4
#: The longest n-gram vLLM's prompt lookup matches (``prompt_lookup_max``), and the shortest.
PROMPT_LOOKUP_MAX = 4
PROMPT_LOOKUP_MIN = 2

#: Ollama's parser (and renderer) names -> the vLLM ``--tool-call-parser`` and ``--reasoning-parser`` that
#: read the same output (``None``: that part has no parser). Names not here have no vLLM counterpart.
OLLAMA_PARSERS: dict[str, tuple[str | None, str | None]] = {
    "qwen3": ("hermes", "qwen3"),
    "qwen3-thinking": ("hermes", "qwen3"),
    "qwen3.5": ("qwen3_coder", "qwen3"),
    "qwen3-coder": ("qwen3_coder", None),
    "qwen3-vl-instruct": ("hermes", None),
    "qwen3-vl-thinking": ("hermes", "qwen3"),
    "ministral": ("mistral", "mistral"),
    "harmony": ("openai", "openai_gptoss"),
    "deepseek3": ("deepseek_v31", "deepseek_v3"),
    "deepseek3.1": ("deepseek_v31", "deepseek_v3"),
    "olmo3": ("olmo3", None),
    "olmo3-think": ("olmo3", "olmo3"),
    "nemotron-3-nano": ("qwen3_coder", "nemotron_v3"),
    "functiongemma": ("functiongemma", None),
    "glm-4.7": ("glm47", "glm45"),
    "gemma4": ("gemma4", "gemma4"),
    "gemma4-no-thinking": ("gemma4", None),
    "lfm2": ("lfm2", None),
    "poolside-v1": ("poolside_v1", "poolside_v1"),
    "glimmer": ("muse_glimmer", "muse_glimmer"),
}

_SEMVER = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+].*)?")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def check_requires(requires: str) -> str:
    """``REQUIRES``' version, without a leading ``v`` (Ollama's ``parser/parser.go`` keeps it so).

    Raises:
        BadRequest: not a semantic version (Ollama: ``requires must be a valid semver``), or one above
            :data:`OLLAMA_API_LEVEL`.
    """
    m = _SEMVER.fullmatch(requires.strip())
    if m is None:
        raise BadRequest(f"requires must be a valid semver (e.g. 0.14.0), not {requires!r}")
    if tuple(map(int, m.groups())) > tuple(map(int, _SEMVER.fullmatch(OLLAMA_API_LEVEL).groups())):  # type: ignore[union-attr]
        raise BadRequest(f"this model requires Ollama {requires.strip().lstrip('v')} or later; vllama speaks Ollama's API "
                         f"at level {OLLAMA_API_LEVEL}")
    return requires.strip().lstrip("v")


def check_parser(parser: str, base_args: tuple[str, ...] | list[str]) -> str:
    """``PARSER`` checked against the parsers the base's vLLM runs with (``base_args``, its ``vllm serve``
    arguments).

    Raises:
        BadRequest: a parser with no vLLM counterpart, or one whose vLLM parsers are not the base's.
    """
    tool, reasoning = _mapped("PARSER", parser)
    runs = vllm_arg(base_args, "--tool-call-parser"), vllm_arg(base_args, "--reasoning-parser")
    for kind, wanted, given in (("--tool-call-parser", tool, runs[0]), ("--reasoning-parser", reasoning, runs[1])):
        if wanted is not None and wanted != given:
            raise BadRequest(f"PARSER {parser} is vLLM's {kind} {wanted}, but the base model's vLLM runs with "
                             f"{given or 'none'}: vLLM parses every name of a model alike; set the parser where the "
                             f"base is served (its vllm_args), or leave PARSER out")
    return parser


def check_renderer(renderer: str, files: ModelFiles) -> str:
    """``RENDERER`` checked against the base's own chat template, which vLLM renders every prompt with.

    Raises:
        BadRequest: a renderer with no vLLM counterpart, or one of another family than the template's.
    """
    tool, reasoning = _mapped("RENDERER", renderer)
    own = detect_parsers(files)
    if (tool is not None and tool != own.tool_call_parser) or (reasoning is not None and own.reasoning_parser is not None
                                                              and reasoning != own.reasoning_parser):
        raise BadRequest(f"RENDERER {renderer} renders prompts for {tool or reasoning}-style output, but vLLM renders this "
                         f"model with its own chat template ({own.reason}): leave RENDERER out")
    return renderer


def _mapped(command: str, name: str) -> tuple[str | None, str | None]:
    found = OLLAMA_PARSERS.get(name.strip())
    if found is None:
        raise BadRequest(f"{command} {name} has no counterpart in vLLM (vllama knows {', '.join(sorted(OLLAMA_PARSERS))}); "
                         f"leave {command} out: vLLM renders with the model's chat template and parses with its "
                         "--tool-call-parser and --reasoning-parser")
    return found


def check_draft(draft: str, state_dir: Path | None = None) -> str:
    """``DRAFT`` as kept: ``ngram``, an absolute directory on the server holding ``config.json``, or a
    Hugging Face repo id (``org/name``: vLLM downloads it when it starts).

    Raises:
        BadRequest: anything else (a relative path, a directory without ``config.json``, GGUF).
    """
    draft = draft.strip()
    if draft.lower() in ("ngram", "[ngram]"):
        return "ngram"
    path = Path(draft).expanduser()
    if path.is_absolute():
        if not path.is_dir():
            raise BadRequest(f"DRAFT {draft}: no such directory on the server")
        if not (path / "config.json").is_file():
            raise BadRequest(f"DRAFT {draft}: a draft model is a Hugging Face model directory (config.json, "
                             "*.safetensors); vLLM does not load GGUF drafts")
        return str(path)
    if _REPO.fullmatch(draft) and not draft.startswith("."):
        return draft
    raise BadRequest(f"DRAFT {draft!r}: name a model directory on the server, a Hugging Face repo id (org/name), or ngram")


def draft_tokens(value: object) -> int:
    """``PARAMETER draft_num_predict`` as vLLM's ``num_speculative_tokens``.

    Raises:
        BadRequest: not a whole number from 1 to 64.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise BadRequest(f"invalid parameter draft_num_predict: a whole number from 1 to 64, not {value!r}")
    return value


def speculative_json(draft: str, tokens: int | None) -> str:
    """vLLM's ``--speculative-config`` for ``draft`` (:func:`check_draft`'s form) drafting ``tokens`` at a
    time (:data:`DEFAULT_DRAFT_TOKENS` when ``None``): JSON with sorted keys, so that the same draft is
    the same argument."""
    n = tokens or DEFAULT_DRAFT_TOKENS
    if draft == "ngram":
        config: dict[str, object] = {"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": PROMPT_LOOKUP_MAX,
                                     "prompt_lookup_min": PROMPT_LOOKUP_MIN}
    else:
        config = {"model": draft, "num_speculative_tokens": n}
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


__all__ = ["DEFAULT_DRAFT_TOKENS", "OLLAMA_API_LEVEL", "OLLAMA_PARSERS", "check_draft", "check_parser", "check_renderer",
           "check_requires", "draft_tokens", "speculative_json"]
