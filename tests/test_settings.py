"""Settings: precedence, OLLAMA_HOST, the `--` pass-through, and the README table staying true."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from vllama_proxy.cli import load_settings
from vllama_proxy.settings import parse_ollama_host


@pytest.mark.parametrize("value,expected", [
    ("0.0.0.0", ("0.0.0.0", 11434)),
    ("0.0.0.0:8080", ("0.0.0.0", 8080)),
    (":9000", ("127.0.0.1", 9000)),
    ("http://example.internal:1234", ("example.internal", 1234)),
    ("[::1]:5000", ("::1", 5000)),
])
def test_parse_ollama_host(value, expected):
    assert parse_ollama_host(value) == expected


def test_precedence(monkeypatch):
    monkeypatch.setenv("OLLAMA_HOST", "0.0.0.0:9999")
    s = load_settings(["--upstream", "http://127.0.0.1:8000"])
    assert (s.host, s.port) == ("0.0.0.0", 9999)
    monkeypatch.setenv("VLLAMA_PORT", "7000")
    s = load_settings(["--upstream", "http://127.0.0.1:8000"])
    assert (s.host, s.port) == ("127.0.0.1", 7000)  # ours win over OLLAMA_HOST
    s = load_settings(["--upstream", "http://127.0.0.1:8000", "--port", "7001"])
    assert s.port == 7001


def test_passthrough_and_aliases():
    s = load_settings(["--upstream", "http://x:1/", "--alias", "a:1b=A/B", "--", "--max-model-len", "8192", "--enable-auto-tool-choice"])
    assert s.upstream == "http://x:1" and s.alias == {"a:1b": "A/B"}
    assert s.vllm_args == ["--max-model-len", "8192", "--enable-auto-tool-choice"]


def test_bad_values_exit_2():
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--upstream", "ftp://x"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "upstream" in r.stderr
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "--upstream" in r.stderr


def test_readme_settings_table_is_current():
    table = subprocess.run([sys.executable, "scripts/settings_table.py"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    readme = (ROOT / "README.md").read_text()
    assert table.strip() in readme, "README settings table is stale: run scripts/settings_table.py"
