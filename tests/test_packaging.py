"""``pip install -e .`` prints no warning (issue 37.7: setuptools warned three times that
``project.license`` as a TOML table is deprecated).

The build backend's hooks are called as pip calls them (in a child process with Python's default
warning filters, on a copy of the project so nothing is written into the checkout), with the
setuptools of this environment: offline, about a second.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib

from conftest import ROOT

HOOKS = """
import os
from setuptools import build_meta as backend
backend.get_requires_for_build_editable()
for hook, out in ((backend.prepare_metadata_for_build_editable, "editable"), (backend.prepare_metadata_for_build_wheel, "wheel")):
    os.mkdir(out)
    print(hook(out))
"""


def test_the_build_backend_warns_of_nothing(tmp_path):
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "vllama_proxy", tmp_path / "vllama_proxy", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-c", HOOKS], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if re.search(r"Warning|deprecat", line, re.I)]
    assert not warnings, r.stderr
    for metadata in (tmp_path / "editable").glob("*.dist-info/METADATA"), (tmp_path / "wheel").glob("*.dist-info/METADATA"):
        assert "License-Expression: Apache-2.0" in next(metadata).read_text().splitlines()


def test_the_setuptools_floor_reads_the_license_string():
    """``license = "Apache-2.0"`` (PEP 639) needs setuptools 77: an older one refuses the string."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    [floor] = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert tuple(int(x) for x in floor.split(">=")[1].split(".")) >= (77,)
