"""``vllama create NAME [-f Modelfile]`` and ``vllama help [COMMAND]`` (issue 37.2, 37.7): the real
command line as subprocesses against a real ``vllama serve --upstream`` over the stand-in vLLM.

Ollama's behaviour is its ``cmd/cmd.go`` ``CreateHandler`` and ``parser/parser.go``
``CreateRequest``: ``-f`` defaults to ``./Modelfile`` (none: the current directory is the
model), paths in ``FROM``/``ADAPTER`` resolve against the Modelfile's directory, progress on
stderr, an error as one ``Error: ...`` line and exit status 1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import ALIAS, ROOT, SERVED

LORA = ROOT / "tests" / "assets" / "tool-lora"
DIGEST = r"sha256:[0-9a-f]{64}"


def vllama(proxy, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``vllama ARGS`` (the real entry point) in ``cwd``, stdin and stdout not a terminal."""
    env = {k: v for k, v in os.environ.items() if k != "OLLAMA_API_KEY"}
    env.update(OLLAMA_HOST=proxy.url, TERM="dumb", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "vllama_proxy", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=60)


@pytest.fixture
def created(proxy):
    """Names the test creates; deleted afterwards (the session's proxy lists every created model)."""
    names: list[str] = []
    yield names
    for name in names:
        httpx.request("DELETE", proxy.url + "/api/delete", json={"model": name}, timeout=10)


def test_show_modelfile_edited_and_created_again(proxy, created, tmp_path, upstream_requests):
    """Ollama's round trip: ``show --modelfile > Modelfile``, edited, ``create -f Modelfile``. It was a
    400 (``TEMPLATE is not supported``: show prints the model's chat template); the model's own
    template is now taken back, and FROM names the model shown, not where its weights lie."""
    shown = vllama(proxy, "show", ALIAS, "--modelfile")
    assert shown.returncode == 0, shown.stderr
    assert f"\nFROM {ALIAS}\n" in shown.stdout and '\nTEMPLATE """{% for m in messages %}' in shown.stdout
    text = shown.stdout.replace("PARAMETER temperature 0.7", "PARAMETER temperature 0.2") + 'SYSTEM "You are Mario."\n'
    (tmp_path / "Modelfile").write_text(text)
    created.append("mario")
    r = vllama(proxy, "create", "mario", "-f", str(tmp_path / "Modelfile"))
    assert (r.returncode, r.stdout) == (0, ""), r.stderr
    again = vllama(proxy, "show", "mario", "--modelfile").stdout
    assert f"\nFROM {ALIAS}\n" in again and '\nSYSTEM "You are Mario."\n' in again and "PARAMETER temperature 0.2" in again
    assert vllama(proxy, "run", "mario", "hi [[tokens:1]]").returncode == 0
    [sent] = upstream_requests("/v1/chat/completions")
    assert sent["body"]["model"] == SERVED and sent["body"]["temperature"] == 0.2
    assert sent["body"]["messages"][0] == {"role": "system", "content": "You are Mario."}
    # a template of one's own is still refused, in one line: vLLM applies the model's own Jinja
    (tmp_path / "Modelfile").write_text(text.replace("{% for m in messages %}", "{% for m in messages|reverse %}"))
    r = vllama(proxy, "create", "mario2", "-f", str(tmp_path / "Modelfile"))
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1].startswith("Error: TEMPLATE is not supported unless it is the model's own chat template")


def test_progress_as_ollamas_and_the_default_modelfile_in_the_current_directory(proxy, created, tmp_path):
    (tmp_path / "Modelfile").write_text(f"FROM {SERVED}\nSYSTEM terse\nPARAMETER temperature 0\n")
    created.append("terse")
    r = vllama(proxy, "create", "terse", cwd=tmp_path)  # no -f: ./Modelfile, as Ollama's
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == "gathering model components"
    assert re.fullmatch(f"using existing layer {DIGEST}", lines[1]), lines
    assert [re.fullmatch(f"creating new layer {DIGEST}", line) is not None for line in lines[2:-2]] == [True, True], lines
    assert lines[-2:] == ["writing manifest", "success"]
    assert "terse:latest" in vllama(proxy, "list").stdout


@pytest.mark.parametrize(
    ("modelfile", "args", "error"),
    [
        (None, ["-f", "nope/Modelfile"], "specified Modelfile wasn't found"),
        ("FROM fake-model\nWOBBLE 3\n", [], "invalid Modelfile line 2: 'WOBBLE 3' (commands: FROM, SYSTEM, PARAMETER, MESSAGE, ...)"),
        ('FROM fake-model\nSYSTEM """never closed\n', [], 'invalid Modelfile: unterminated """'),
        ("SYSTEM hi\n", [], "no FROM line"),
        ("FROM nope:1b\n", [], "model 'nope:1b' not found"),
        ("FROM fake-model\nADAPTER ./no-such-lora\n", [], "ADAPTER ./no-such-lora: no such directory"),
        ("FROM fake-model\nADAPTER /no/such/lora\n", [], "adapter /no/such/lora: no such directory on the server"),
        ("FROM fake-model\nADAPTER a/b\nADAPTER c/d\n", [], "one adapter per model"),
        ("FROM fake-model\n", ["-q", "q4_K_M"], "quantize is not supported: vLLM serves published quantizations"),
    ],
)
def test_errors_are_one_line_and_exit_1(proxy, tmp_path, modelfile, args, error):
    if modelfile is not None:
        (tmp_path / "Modelfile").write_text(modelfile)
    r = vllama(proxy, "create", "x", *args, cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"Error: {error}"), r.stderr
    assert [line for line in r.stderr.splitlines() if line != "gathering model components"] == [last]  # no traceback
    if modelfile is None or "WOBBLE" in modelfile or "SYSTEM hi" in modelfile:  # read before anything is sent
        assert r.stderr == last + "\n"


def test_no_modelfile_and_no_model_in_the_directory(proxy, tmp_path):
    """Ollama: without ``-f`` and ``./Modelfile`` the current directory is the model (``FROM .``)."""
    r = vllama(proxy, "create", "x", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == "Error: no Modelfile or safetensors files found"


def test_paths_resolve_against_the_modelfiles_directory_and_are_uploaded(proxy, tmp_path):
    """``ADAPTER ./lora`` and ``FROM ./weights`` next to the Modelfile, run from another directory: the
    files are found there, uploaded as blobs (``copying file sha256:...``), and the server judges them
    (the shipped adapter is for another base: its 400; a model made of files needs on-demand models,
    which ``--upstream`` has not: its 400)."""
    here = tmp_path / "models"
    (here / "lora").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md"):  # a README is not sent
        shutil.copy(LORA / name, here / "lora" / name)
    (here / "Modelfile").write_text("FROM fake-model\nADAPTER ./lora\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = vllama(proxy, "create", "x", "-f", "../models/Modelfile", cwd=elsewhere)
    assert r.returncode == 1
    copied = [line for line in r.stderr.splitlines() if line.startswith("copying file ")]
    assert len(copied) == 2 and all(re.fullmatch(f"copying file {DIGEST}", line) for line in copied), r.stderr
    assert r.stderr.splitlines()[-1].startswith("Error: base mismatch: the adapter's "), r.stderr
    for digest in (line.split()[-1] for line in copied):  # both on the server now
        assert httpx.head(f"{proxy.url}/api/blobs/{digest}", timeout=10).status_code == 200

    weights = here / "weights"
    weights.mkdir()
    (weights / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    (weights / "model.safetensors").write_bytes(b"\0" * 16)
    (weights / "model.gguf").write_bytes(b"GGUF")  # not vLLM's: left out
    (here / "Modelfile").write_text("FROM weights\n")
    r = vllama(proxy, "create", "x", "-f", str(here / "Modelfile"), cwd=elsewhere)
    assert r.returncode == 1
    assert len([line for line in r.stderr.splitlines() if line.startswith("copying file ")]) == 2, r.stderr
    assert r.stderr.splitlines()[-1].startswith("Error: a model made from files runs on demand"), r.stderr


def test_a_local_draft_directory_is_uploaded_as_draft_files(proxy, tmp_path):
    """Ollama 0.33's ``DRAFT ./dir`` beside the Modelfile: uploaded (``draft_files``), as Ollama's client does,
    not sent as a path the server cannot read; this server (``--upstream``) then says why it cannot start it."""
    here = tmp_path / "m"
    shutil.copytree(ROOT / "tests" / "assets" / "tool-model", here / "draft")
    (here / "Modelfile").write_text("FROM fake-model\nDRAFT ./draft\nPARAMETER draft_num_predict 3\n")
    done = vllama(proxy, "create", "fast", "-f", str(here / "Modelfile"), cwd=tmp_path)
    assert done.returncode == 1
    assert re.search(f"copying file {DIGEST}", done.stderr), done.stderr  # uploaded
    assert done.stderr.strip().splitlines()[-1].startswith("Error: DRAFT needs vllama to launch the base model's vLLM"), done.stderr
    done = vllama(proxy, "create", "fast", cwd=tmp_path, *["-f", str(_write(tmp_path / "M2", "FROM fake-model\nDRAFT ./nope\n"))])
    assert done.returncode == 1 and "DRAFT ./nope: no such directory" in done.stderr


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_experimental_is_a_note_not_silence(proxy, created, tmp_path):
    (tmp_path / "Modelfile").write_text(f"FROM {SERVED}\nSYSTEM s\n")
    created.append("exp")
    r = vllama(proxy, "create", "exp", "--experimental", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("note: --experimental is Ollama's direct import of safetensors; vLLM serves")
    assert r.stderr.splitlines()[-1] == "success"


def test_help_as_ollamas(proxy):
    """``vllama help [COMMAND]``: it was ``unknown command 'help'``."""
    r = vllama(proxy, "help")
    assert r.returncode == 0 and r.stdout == vllama(proxy, "--help").stdout and "  create   " in r.stdout
    for command, words in (("create", "usage: vllama create"), ("run", "usage: vllama run"), ("serve", "usage: vllama serve"),
                           ("batch", "usage: vllama batch")):
        r = vllama(proxy, "help", command)
        assert r.returncode == 0 and r.stdout.startswith(words), (command, r.stdout, r.stderr)
        assert r.stdout == vllama(proxy, command, "--help").stdout
    r = vllama(proxy, "help", "nope")
    assert r.returncode == 0 and r.stdout.startswith("Unknown help topic [`nope`]\nusage: vllama COMMAND")


def test_a_real_chat_template_survives_the_modelfile():
    """The shipped tool model's Jinja template (quotes, braces, new lines), written as show writes it
    and read back as create reads it, is the model's own: accepted."""
    import json

    from vllama_proxy import read_modelfile
    from vllama_proxy.api.routes.create import same_template

    own = json.loads((ROOT / "tests" / "assets" / "tool-model" / "tokenizer_config.json").read_text())["chat_template"]
    back = read_modelfile(f'FROM tool\nTEMPLATE """{own}"""\nPARAMETER temperature 0.7\n')["template"]
    assert back == own and same_template(back, own) and same_template(back.replace("\n", "\r\n") + "\n", own)
    assert not same_template(back.replace("im_start", "im_begin"), own) and not same_template(back, None)
