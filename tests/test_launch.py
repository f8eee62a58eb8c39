"""``vllama launch TOOL`` (issue 40): a stand-in tool on PATH records what it was started with.

The stand-in is a script named like the tool (``claude``, ``codex``, ``opencode``) that writes its
argv and environment as JSON and exits; ``vllama launch`` execs it as it would the real tool, so
the test sees exactly what Claude Code, Codex or OpenCode would receive.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, SERVED

CODE = "import sys; from vllama_proxy.client.main import main; sys.exit(main(sys.argv[1], sys.argv[2:]))"
STAND_IN = """#!{python}
import json, os, sys
with open(os.environ["STAND_IN_OUT"], "w") as f:
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)
"""


@pytest.fixture
def tools(tmp_path) -> Path:
    """A folder holding stand-ins for every tool (put first on PATH by :func:`launch`)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("claude", "codex", "opencode", "copilot", "qwen", "kimi", "pool", "droid"):
        p = folder / name
        p.write_text(STAND_IN.format(python=sys.executable))
        p.chmod(0o755)
    return folder


def launch(host: str, *args: str, path: str, key: str | None = None, out: Path | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_API_KEY", "ANTHROPIC_API_KEY")}
    env.update(OLLAMA_HOST=host, PATH=path, STAND_IN_OUT=str(out or "/dev/null"), ANTHROPIC_API_KEY="a-stored-anthropic-key")
    if key is not None:
        env["OLLAMA_API_KEY"] = key
    done = subprocess.run([sys.executable, "-c", CODE, "launch", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=30)
    got = json.loads(out.read_text()) if out is not None and out.exists() and out.stat().st_size else {}
    return done, got


def test_claude_gets_the_anthropic_variables_and_the_model_for_every_tier(proxy, tools, tmp_path):
    done, got = launch(proxy.url, "claude", "--model", SERVED, "--", "-p", "hello", path=f"{tools}:{os.environ['PATH']}",
                       out=tmp_path / "got.json")
    assert done.returncode == 0, done.stderr
    assert got["argv"][1:] == ["--model", SERVED, "-p", "hello"]
    env = got["env"]
    assert env["ANTHROPIC_BASE_URL"] == proxy.url
    assert env["ANTHROPIC_AUTH_TOKEN"] == "vllama" and env["ANTHROPIC_API_KEY"] == ""  # the stored key is not sent instead
    for var in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert env[var] == SERVED, var


def test_codex_gets_a_responses_provider_and_the_key_of_a_remote_server(proxy, tools, tmp_path):
    # the host as a user writes it for a remote server: no scheme, a key in OLLAMA_API_KEY
    host = proxy.url.removeprefix("http://")
    done, got = launch(host, "codex", "--model", SERVED, path=f"{tools}:{os.environ['PATH']}", key="sk-team-1",
                       out=tmp_path / "got.json")
    assert done.returncode == 0, done.stderr
    argv = got["argv"][1:]
    settings = dict(a.split("=", 1) for a in argv[1:-2:2])
    assert argv[0::2][:-1] == ["-c"] * (len(argv) // 2 - 1) and argv[-2:] == ["-m", SERVED]
    assert settings == {"model_provider": '"vllama"', "model_providers.vllama.name": '"vllama"',
                        "model_providers.vllama.base_url": f'"{proxy.url}/v1"', "model_providers.vllama.wire_api": '"responses"',
                        "model_providers.vllama.env_key": '"VLLAMA_API_KEY"'}
    assert got["env"]["VLLAMA_API_KEY"] == "sk-team-1"


def test_opencode_gets_its_provider_inline(proxy, tools, tmp_path):
    done, got = launch(proxy.url, "opencode", "--model", SERVED, path=f"{tools}:{os.environ['PATH']}", key="sk-2",
                       out=tmp_path / "got.json")
    assert done.returncode == 0, done.stderr
    config = json.loads(got["env"]["OPENCODE_CONFIG_CONTENT"])
    assert config["model"] == f"vllama/{SERVED}"
    provider = config["provider"]["vllama"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": f"{proxy.url}/v1", "apiKey": "sk-2"}
    assert list(provider["models"]) == [SERVED]


def test_a_missing_tool_is_one_line_with_its_install_command(proxy, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done, _ = launch(proxy.url, "codex", "--model", SERVED, path=str(empty))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["Error: codex is not installed; install it with: npm install -g @openai/codex"]


def test_config_prints_what_it_would_set_without_the_key(proxy, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done, _ = launch(proxy.url, "claude", "--model", SERVED, "--config", path=str(empty), key="sk-secret")
    assert done.returncode == 0, done.stderr
    assert "sk-secret" not in done.stdout
    assert 'export ANTHROPIC_AUTH_TOKEN="$OLLAMA_API_KEY"' in done.stdout
    assert f"export ANTHROPIC_BASE_URL={proxy.url}" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == f"claude --model {SERVED}"


def test_an_unknown_model_stops_before_the_tool_starts(proxy, tools, tmp_path):
    done, got = launch(proxy.url, "claude", "--model", "no-such-model", path=f"{tools}:{os.environ['PATH']}", out=tmp_path / "got.json")
    assert done.returncode == 1 and got == {}
    assert "no-such-model" in done.stderr and "not found" in done.stderr


def test_a_model_and_its_aliases_are_one_model(proxy, tools, tmp_path):
    # the stand-in stack lists two names of one model (the model and its alias, one digest): launched with the model's
    # own name, nothing asked (before, it said to name one of the two)
    done, got = launch(proxy.url, "claude", "--config", path=f"{tools}:{os.environ['PATH']}")
    assert done.returncode == 0, done.stderr
    assert f"export ANTHROPIC_MODEL={SERVED}:latest" in done.stdout.splitlines()


@pytest.fixture
def two_models(fake):
    """A vllama over the stand-in with a second model made from the first (``/api/create``: a digest of its own)."""
    from conftest import start_proxy, stop
    p = start_proxy(fake.url)
    req = urllib.request.Request(p.url + "/api/create", data=json.dumps({"model": "terse", "from": SERVED, "system": "Be terse.",
                                                                       "stream": False}).encode(), method="POST")
    assert json.loads(urllib.request.urlopen(req, timeout=30).read())["status"] == "success"
    yield p
    stop(p.proc)


def test_without_a_model_and_no_terminal_it_says_which_to_name(two_models, tools, tmp_path):
    done, got = launch(two_models.url, "claude", path=f"{tools}:{os.environ['PATH']}", out=tmp_path / "got.json")
    assert done.returncode == 1 and got == {}
    assert done.stderr.strip() == f"Error: name the model with --model (the server has: {SERVED}:latest, terse:latest)"


def test_on_a_terminal_it_asks_which_model_tool_capable_ones_marked(two_models, tools, tmp_path):
    out = tmp_path / "got.json"
    env = {k: v for k, v in os.environ.items() if k != "OLLAMA_API_KEY"}
    env.update(OLLAMA_HOST=two_models.url, PATH=f"{tools}:{os.environ['PATH']}", STAND_IN_OUT=str(out), TERM="dumb")
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-c", CODE, "launch", "claude"], stdin=slave, stdout=slave, stderr=slave,
                            env=env, cwd=ROOT, start_new_session=True)
    os.close(slave)
    seen = b""
    try:
        while b"Select a model [1]: " not in seen:
            assert select.select([master], [], [], 20)[0], seen
            seen += os.read(master, 4096)
        os.write(master, b"2\n")
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = seen.decode()
    assert f"1. {SERVED}:latest  (tools)  (also fake:7b)" in text and "2. terse:latest  (tools)" in text
    assert json.loads(out.read_text())["env"]["ANTHROPIC_MODEL"] == "terse:latest"


def test_copilot_gets_its_provider_variables_and_the_responses_wire(proxy, tools, tmp_path):
    done, got = launch(proxy.url, "copilot", "--model", SERVED, "--", "-p", "hi", path=f"{tools}:{os.environ['PATH']}", key="sk-3",
                       out=tmp_path / "got.json")
    assert done.returncode == 0, done.stderr
    assert got["argv"][1:] == ["--model", SERVED, "-p", "hi"]
    env = got["env"]
    assert (env["COPILOT_PROVIDER_BASE_URL"], env["COPILOT_PROVIDER_API_KEY"], env["COPILOT_PROVIDER_WIRE_API"], env["COPILOT_MODEL"]) == (
        f"{proxy.url}/v1", "sk-3", "responses", SERVED)


def test_qwen_code_gets_the_openai_auth_type_and_variables(proxy, tools, tmp_path):
    done, got = launch(proxy.url, "qwen", "--model", SERVED, path=f"{tools}:{os.environ['PATH']}", out=tmp_path / "got.json")
    assert done.returncode == 0, done.stderr
    assert got["argv"][1:] == ["--auth-type", "openai", "--model", SERVED]
    env = got["env"]
    assert (env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"], env["OPENAI_MODEL"]) == (f"{proxy.url}/v1", "vllama", SERVED)


def test_kimi_gets_its_whole_config_inline_with_the_models_context(proxy, tools, tmp_path):
    done, got = launch(proxy.url, "kimi", "--model", SERVED, path=f"{tools}:{os.environ['PATH']}", key="sk-4", out=tmp_path / "got.json")
    assert done.returncode == 0, done.stderr
    assert got["argv"][1] == "--config"
    config = json.loads(got["argv"][2])
    assert config["default_model"] == "vllama"
    assert config["providers"]["vllama"] == {"type": "openai_legacy", "base_url": f"{proxy.url}/v1", "api_key": "sk-4"}
    model = config["models"]["vllama"]
    assert model["provider"] == "vllama" and model["model"] == SERVED
    with urllib.request.urlopen(f"{proxy.url}/api/show", json.dumps({"model": SERVED}).encode(), timeout=10) as r:
        shown = json.loads(r.read())
    assert model["max_context_size"] == shown["details"]["context_length"] > 0


def test_pool_gets_the_standalone_variables(proxy, tools, tmp_path):
    done, got = launch(proxy.url, "pool", "--model", SERVED, path=f"{tools}:{os.environ['PATH']}", out=tmp_path / "got.json")
    assert done.returncode == 0, done.stderr
    assert got["argv"][1:] == ["-m", SERVED]
    assert (got["env"]["POOLSIDE_STANDALONE_BASE_URL"], got["env"]["POOLSIDE_API_KEY"]) == (f"{proxy.url}/v1", "vllama")


def test_droid_gets_a_custom_model_in_its_settings_file_and_keeps_the_rest(proxy, tools, tmp_path, monkeypatch):
    home = tmp_path / "home"
    settings = home / ".factory" / "settings.json"
    settings.parent.mkdir(parents=True)
    theirs = {"model": "gpt-x", "displayName": "mine", "baseUrl": "https://elsewhere/v1", "apiKey": "k", "provider": "openai"}
    settings.write_text(json.dumps({"customModels": [theirs], "sessionDefaultSettings": {"reasoningEffort": "high"}, "theme": "dark"}))
    monkeypatch.setenv("HOME", str(home))
    for _ in range(2):  # a second launch replaces vllama's entry, not adds one
        done, got = launch(proxy.url, "droid", "--model", SERVED, "--", "exec", "hi", path=f"{tools}:{os.environ['PATH']}", key="sk-5",
                           out=tmp_path / "got.json")
        assert done.returncode == 0, done.stderr
    assert got["argv"][1:] == ["exec", "hi"]
    written = json.loads(settings.read_text())
    ours = written["customModels"][0]
    assert written["customModels"][1:] == [theirs] and written["theme"] == "dark"
    assert (ours["model"], ours["baseUrl"], ours["apiKey"], ours["provider"]) == (SERVED, f"{proxy.url}/v1", "sk-5", "generic-chat-completion-api")
    assert written["sessionDefaultSettings"] == {"reasoningEffort": "high", "model": ours["id"]}
    assert oct(settings.stat().st_mode & 0o777) == "0o600"  # it holds the key
    assert (settings.parent / "settings.json.vllama.bak").exists()


def test_droid_config_prints_the_file_without_the_key_and_writes_nothing(proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    done, _ = launch(proxy.url, "droid", "--model", SERVED, "--config", path=str(empty), key="sk-secret")
    assert done.returncode == 0, done.stderr
    assert "sk-secret" not in done.stdout and '"apiKey": "$OLLAMA_API_KEY"' in done.stdout
    assert not (tmp_path / ".factory").exists()


@pytest.mark.parametrize("tool, line", [("copilot", "npm install -g @github/copilot"), ("qwen", "npm install -g @qwen-code/qwen-code"),
                                        ("kimi", "uv tool install kimi-cli"), ("droid", "curl -fsSL https://app.factory.ai/cli | sh")])
def test_each_missing_tool_is_one_line_saying_how_to_install_it(proxy, tmp_path, tool, line):
    empty = tmp_path / "empty"
    empty.mkdir()
    done, _ = launch(proxy.url, tool, "--model", SERVED, path=str(empty))
    assert done.returncode == 1
    [said] = done.stderr.strip().splitlines()
    assert said.startswith(f"Error: {tool} is not installed; install it with: {line}")
