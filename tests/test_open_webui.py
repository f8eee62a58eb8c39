"""Open WebUI, for real (issue 14): the most used Ollama front end, in headless Chromium, against vllama.

One recorded browser session: sign in, the model list, a streamed chat, a tool call, a thinking
block, a generation stopped midway (vLLM must see the abort), a document answered through
embeddings (``/api/embed``), the model ejected from the model list (its vLLM stopped) and loaded
again by the next chat. vllama runs as a real ``vllama serve --config`` process supervising
two stand-in vLLMs (``tests/fake_vllm.py``: a chat model with tool and reasoning parsers, and a
pooling model); Open WebUI is a real ``open-webui serve`` process with ``OLLAMA_BASE_URL`` pointing
at vllama. Afterwards every request Open WebUI sent to vllama (vllama's JSON access log) must have
been answered without error; the one request the stop cancels is logged 499, Ollama's status for
a client that left.

Optional, skipped unless everything it needs is here (CI has none of it and installs nothing)::

    apt-get install -y chromium                     # Debian's; VLLAMA_CHROMIUM to use another
    python3.11 -m venv /work/owui-venv              # Open WebUI in a venv of its own (it is heavy)
    /work/owui-venv/bin/pip install torch==2.13.0   # the local CPU wheel, before open-webui asks for torch
    /work/owui-venv/bin/pip install open-webui
    .venv/bin/pip install playwright                # the driver only: never `playwright install`
    VLLAMA_OPEN_WEBUI=/work/owui-venv/bin/open-webui scripts/test.sh -s tests/test_open_webui.py

Measured with open-webui 0.12.4, Chromium 156, playwright 1.65: about 50 s. The second test signs two users in
behind one trusted-front key (``api/policy/end_users.py``): one user's flood does not stall the other's chat, and the
ledger names both (2026-11-29, open-webui 0.12.4, Chromium 156.0.8078.108, playwright 1.65.2: 88 s; the second user's
answer on screen 0.9 s after Enter, 3rd upstream ahead of 8 flood requests waiting; with the key not a trusted front
he was still waiting 41 s later: ``benchmarks/RESULTS.md``).
``VLLAMA_OPEN_WEBUI_SHOTS=DIR`` keeps the screenshots and the request table there (the recorded
ones are in ``abcf5ef:benchmarks/results/open-webui/``, in the repository's history); otherwise they go to the test's temporary directory.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, get_json, stop, write_model_dir

OPEN_WEBUI = os.environ.get("VLLAMA_OPEN_WEBUI", "")
CHROMIUM = os.environ.get("VLLAMA_CHROMIUM", "/usr/bin/chromium")

pytestmark = [
    pytest.mark.skipif(not OPEN_WEBUI or not shutil.which(OPEN_WEBUI),
                       reason="set VLLAMA_OPEN_WEBUI to an open-webui executable (see this module's docstring)"),
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="no playwright in this venv (pip install playwright; the browser is Debian's chromium)"),
    pytest.mark.timeout(900),
]

# Chromium as the machine allows it: no sandbox as root, and no background connections to Google's
# hosts (this network refuses them).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
EMAIL, PASSWORD = "admin@example.com", "vllama-open-webui"
DOCUMENT = """vllama field notes

vllama is a proxy that speaks the Ollama HTTP API in front of vLLM's OpenAI-compatible server.
The secret word of this document is marmalade. The proxy streams NDJSON and aborts upstream work
when a client leaves. Embeddings for this document come from /api/embed, served by a pooling
model behind vllama.
"""
CONFIG = """\
keep_alive = "-1"

[[models]]
model = "{models}/qwen-fake"
name = "qwen-fake"
gpu_memory_utilization = 0.45
tool_call_parser = "hermes"
reasoning_parser = "qwen3"

[[models]]
model = "{models}/embed-fake"
name = "embed-fake"
gpu_memory_utilization = 0.05
vllm_args = ["--runner", "pooling"]
"""


def fake_url(v, name: str) -> str:
    """The private URL of ``name``'s stand-in vLLM: the latest launch line of vllama's log."""
    url = ""
    for line in v.log.read_text().splitlines():
        if '"launched"' in line:
            argv = json.loads(line)["argv"]
            if argv[argv.index("--served-model-name") + 1] == name:
                url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    assert url, f"no launch of {name} in the log"
    return url


def wait_until(check, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def access_log(v) -> list[dict]:
    """vllama's access-log lines (one per request: method, path, status, stream_error when a stream failed)."""
    out = []
    for line in v.log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "request":
            out.append(rec)
    return out


def request_table(records: list[dict]) -> str:
    counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        counts[(r["method"], r["path"])][r["status"]] += 1
    lines = ["| method | path | count | statuses |", "|---|---|---|---|"]
    for (method, path), statuses in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        shown = ", ".join(f"{s} x{n}" for s, n in sorted(statuses.items()))
        lines.append(f"| {method} | `{path}` | {sum(statuses.values())} | {shown} |")
    return "\n".join(lines)


@pytest.fixture
def open_webui_session(vllama, tmp_path):
    """vllama over two stand-in vLLMs, and Open WebUI pointed at it; yields (vllama, Open WebUI URL)."""
    models = tmp_path / "models"
    write_model_dir(models / "qwen-fake")
    write_model_dir(models / "embed-fake")
    # 50 ms a token: an answer streams visibly, and a long one is still running when Stop is clicked
    v = vllama(config=CONFIG.format(models=models), env={"FAKE_VLLM_TOKEN_DELAY": "0.05"})
    wait_until(lambda: v.ready()["state"] == "ready" and all(m["state"] == "ready" for m in v.ready()["models"]),
               60, "both models ready")
    port = free_port()
    data = tmp_path / "open-webui"
    data.mkdir()
    env = {
        **os.environ,
        "DATA_DIR": str(data),
        "OLLAMA_BASE_URL": v.url,
        "ENABLE_OLLAMA_API": "true",
        "ENABLE_OPENAI_API": "false",
        # documents are embedded by vllama's /api/embed, not a local sentence-transformers model
        "RAG_EMBEDDING_ENGINE": "ollama",
        "RAG_EMBEDDING_MODEL": "embed-fake:latest",
        "WEBUI_ADMIN_EMAIL": EMAIL,
        "WEBUI_ADMIN_PASSWORD": PASSWORD,
        "WEBUI_SECRET_KEY": "vllama-test-secret",
        # nothing from the network: no update check, no hub downloads, no telemetry
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "ANONYMIZED_TELEMETRY": "false",
        "DO_NOT_TRACK": "true",
        "SCARF_NO_ANALYTICS": "true",
    }
    log = (tmp_path / "open-webui.log").open("wb")
    proc = subprocess.Popen([OPEN_WEBUI, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=data,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, f"open-webui exited {proc.returncode}; see {tmp_path / 'open-webui.log'}"
        try:
            return urllib.request.urlopen(url + "/health", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_until(healthy, 240, "Open WebUI to start", interval=0.5)
        yield v, url
    finally:
        stop(proc, timeout=20)
        log.close()


def test_open_webui_session(open_webui_session, tmp_path):
    from playwright import sync_api
    v, base = open_webui_session
    shots = Path(os.environ.get("VLLAMA_OPEN_WEBUI_SHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    qwen = fake_url(v, "qwen-fake")
    embed = fake_url(v, "embed-fake")

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(30_000)
        expect = sync_api.expect

        def shot(name: str) -> None:
            page.screenshot(path=str(shots / name))

        def send(text: str) -> None:
            box = page.locator("#chat-input")
            box.click()
            box.fill(text)
            page.keyboard.press("Enter")

        def answer():
            return page.locator("#response-content-container").last

        def new_chat() -> None:
            page.goto(base + "/")
            expect(page.locator("#chat-input")).to_be_visible()

        # 1. sign in (the admin account comes from WEBUI_ADMIN_EMAIL / WEBUI_ADMIN_PASSWORD)
        page.goto(base + "/auth", wait_until="networkidle")
        page.get_by_placeholder("Enter Your Email").fill(EMAIL)
        page.get_by_placeholder("Enter Your Password").fill(PASSWORD)
        shot("01-sign-in.png")
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator("#chat-input")).to_be_visible()
        try:  # the release notes pop up on a first sign-in
            page.get_by_role("button", name="Okay, Let's Go!").click(timeout=5_000)
        except sync_api.TimeoutError:
            pass

        # 2. the model list: both served models, from /api/tags; the chat model chosen
        page.get_by_role("button", name=re.compile("^Selected model")).first.click()
        models = page.get_by_role("listbox", name="Available models")
        expect(models.get_by_role("option")).to_have_count(2)
        expect(models.get_by_role("option", name="Select embed-fake:latest model")).to_be_visible()
        shot("02-model-list.png")
        models.get_by_role("option", name="Select qwen-fake:latest model").click()
        expect(page.get_by_role("button", name=re.compile("^Selected model: qwen-fake:latest"))).to_be_visible()

        # 3. a chat, streamed: the answer grows on screen before it is complete
        send("Hello from Open WebUI [[tokens:40]]")
        expect(answer()).to_contain_text("tok0")
        seen = set()
        deadline = time.monotonic() + 30
        while "tok39" not in answer().inner_text() and time.monotonic() < deadline:
            n = answer().inner_text().count("tok")
            if 5 <= n <= 30 and not any(5 <= m <= 30 for m in seen):
                shot("03-chat-streaming.png")  # caught midway
            seen.add(n)
            time.sleep(0.1)
        expect(answer()).to_contain_text("tok39")
        assert len([n for n in seen if 0 < n < 40]) >= 2, f"no partial answers seen: {seen}"
        shot("04-chat-streamed.png")

        # 4. a tool call: Open WebUI sends its built-in tools; the model calls one, gets the result, answers
        new_chat()
        send("What time is it? [[tool]]")
        tool_call = page.get_by_text("get_current_timestamp").filter(visible=True).first
        expect(tool_call).to_be_visible()
        expect(answer()).to_contain_text("tok7")
        tool_call.click()  # unfold the call: its arguments and the tool's result
        expect(page.get_by_text("current_iso").filter(visible=True).first).to_be_visible()
        time.sleep(0.5)  # the unfolding animation
        shot("05-tool-call.png")
        calls = [r["body"] for r in get_json(qwen + "/_fake/requests") if r["path"] == "/v1/chat/completions"]
        followup = [b for b in calls if any(m.get("role") == "tool" for m in b["messages"])]
        assert followup, "the tool result never reached vLLM"
        tool_msg = [m for m in followup[-1]["messages"] if m["role"] == "tool"][-1]
        call = [m for m in followup[-1]["messages"] if m.get("tool_calls")][-1]["tool_calls"][0]
        assert tool_msg["tool_call_id"] == call["id"] and call["function"]["name"] == "get_current_timestamp"

        # 5. a thinking block: the chat's "think (Ollama)" control on, reasoning shown folded
        new_chat()
        page.get_by_label("Controls", exact=True).click()
        think = page.get_by_label("think (Ollama)", exact=True)
        think.scroll_into_view_if_needed()
        think.click()
        expect(think).to_have_text("On")  # the pane stays open: the screenshot shows the setting
        send("Think it over first.")
        expect(answer()).to_contain_text("tok7")
        thought = page.get_by_text(re.compile("^Thought for"))
        expect(thought.first).to_be_visible()
        thought.first.click()
        expect(page.get_by_text(re.compile("think0 think1 think2")).first).to_be_visible()
        time.sleep(0.5)  # the unfolding animation
        shot("06-thinking.png")
        page.get_by_label("Controls", exact=True).click()  # closed again: the pane is remembered across chats
        thinking_calls = [r["body"] for r in get_json(qwen + "/_fake/requests")
                          if r["path"] == "/v1/chat/completions" and r["body"]["messages"][-1]["content"] == "Think it over first."]
        assert thinking_calls and thinking_calls[0]["chat_template_kwargs"] == {"enable_thinking": True}

        # 6. stop midway: Open WebUI drops its connection, vllama closes vLLM's, vLLM aborts
        new_chat()
        before = get_json(qwen + "/_fake/stats")
        send("Write a long essay. [[tokens:150]]")
        expect(answer()).to_contain_text("tok10")
        page.get_by_role("button", name="Stop", exact=True).click()
        clicked = time.monotonic()
        after = wait_until(lambda: (s := get_json(qwen + "/_fake/stats"))["aborted"] > before["aborted"] and s, 5,
                           "vLLM to abort the stopped request", interval=0.02)
        abort_s = time.monotonic() - clicked
        shown = answer().inner_text()
        time.sleep(1)
        assert answer().inner_text() == shown and "tok149" not in shown, "the answer kept growing after Stop"
        shot("07-stopped.png")
        assert after["aborted"] == before["aborted"] + 1

        # 7. a document: uploaded, embedded through vllama's /api/embed, retrieved for the question
        new_chat()
        doc = tmp_path / "vllama-notes.txt"
        doc.write_text(DOCUMENT)
        embeds_before = len([r for r in get_json(embed + "/_fake/requests") if r["path"] == "/v1/embeddings"])
        page.locator("input[type=file]").first.set_input_files(str(doc))
        expect(page.get_by_text("vllama-notes.txt").first).to_be_visible()
        wait_until(lambda: len([r for r in get_json(embed + "/_fake/requests") if r["path"] == "/v1/embeddings"]) > embeds_before,
                   60, "the document's embeddings")
        time.sleep(1)  # the file chip leaves its "processing" state
        send("What is the secret word in the document?")
        expect(page.get_by_text(re.compile(r"Retrieved 1 source|1 Source")).first).to_be_visible()
        expect(answer()).to_contain_text("tok7")
        page.get_by_text("1 Source", exact=True).first.click()
        expect(page.get_by_text("vllama-notes.txt").nth(1)).to_be_visible()
        time.sleep(0.5)
        shot("08-document.png")
        embeds = [r["body"] for r in get_json(embed + "/_fake/requests") if r["path"] == "/v1/embeddings"]
        assert any("marmalade" in json.dumps(b["input"]) for b in embeds), "the document was not embedded"
        # the search query (Open WebUI has the chat model write it: here the stand-in's tokens) embedded too
        assert any("marmalade" not in json.dumps(b["input"]) for b in embeds), f"no query embedded: {embeds}"
        rag = [r["body"] for r in get_json(qwen + "/_fake/requests") if r["path"] == "/v1/chat/completions"
               and "marmalade" in json.dumps(r["body"]["messages"])]
        assert rag, "the retrieved passage never reached the chat model"

        # 8. eject: Open WebUI unloads the model (/api/generate, empty prompt, keep_alive 0); vllama stops
        # its vLLM, /api/ps no longer lists it, and the next chat loads it again
        wait_until(lambda: get_json(qwen + "/_fake/stats")["in_flight"] == 0, 60, "background generations to end")
        new_chat()
        page.get_by_role("button", name=re.compile("^Selected model")).first.click()
        option = page.get_by_role("listbox", name="Available models").get_by_role("option", name="Select qwen-fake:latest model")
        option.hover()
        option.get_by_role("button", name="Eject model").click()
        wait_until(lambda: {m["model"]: m["state"] for m in v.ready()["models"]}["qwen-fake"] in ("unloaded", "stopped"), 30,
                   "qwen-fake to be unloaded")
        time.sleep(1)
        shot("09-ejected.png")
        assert [m["model"] for m in get_json(v.url + "/api/ps")["models"]] == ["embed-fake:latest"]
        page.keyboard.press("Escape")
        send("Back again?")
        expect(answer()).to_contain_text("tok7", timeout=60_000)
        assert {m["model"]: m["state"] for m in v.ready()["models"]}["qwen-fake"] == "ready"
        browser.close()

    # Open WebUI's own follow-ups (titles, tags, suggestions) finish before it is stopped
    qwen = fake_url(v, "qwen-fake")  # started again after the eject
    wait_until(lambda: get_json(qwen + "/_fake/stats")["in_flight"] == 0, 60, "background generations to end")
    records = [r for r in access_log(v) if r["path"] not in ("/livez", "/readyz")]  # the test's own probes
    table = request_table(records)
    (shots / "requests.md").write_text(f"{table}\n\nStop clicked -> vLLM aborted the request: {abort_s:.2f} s\n")
    print(table)
    paths = {r["path"] for r in records}
    assert {"/api/tags", "/api/ps", "/api/version", "/api/chat", "/api/embed", "/api/generate"} <= paths
    bad = [r for r in records if r["status"] >= 400 or "stream_error" in r]
    # the one request Stop cancelled is logged 499 (Ollama's "client gone"); nothing else failed
    assert [(r["path"], r["status"]) for r in bad] == [("/api/chat", 499)], bad
    # and Open WebUI itself logged no error about any of it
    errors = [line for line in (tmp_path / "open-webui.log").read_text(errors="replace").splitlines()
              if "| ERROR" in line or "Traceback" in line]
    assert not errors, "\n".join(errors)


KEYS = """
[[keys]]
name = "webui"
key = "sk-webui"
trusted_front = true

[[keys]]
name = "ops"
key = "sk-ops"
role = "admin"
"""
SECOND_EMAIL, SECOND_PASSWORD = "bob@example.com", "vllama-open-webui-bob"


def _api(base: str, method: str, path: str, token: str | None = None, body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"{}")


@pytest.fixture
def open_webui_two_users(vllama, tmp_path):
    """vllama with one trusted-front key (2 running places on one stand-in vLLM) and Open WebUI using that key for
    everyone, forwarding its users' identity (ENABLE_FORWARD_USER_INFO_HEADERS); yields (vllama, Open WebUI URL)."""
    models = tmp_path / "models"
    write_model_dir(models / "qwen-fake")
    (tmp_path / "keys.toml").write_text(KEYS)
    # a tool parser: Open WebUI sends its built-in tools with every chat (without one vllama answers Ollama's
    # "does not support tools" 400)
    config = f'keep_alive = "-1"\n\n[[models]]\nmodel = "{models}/qwen-fake"\nname = "qwen-fake"\ntool_call_parser = "hermes"\n'
    v = vllama(config=config, flags=["--api-key-file", str(tmp_path / "keys.toml"), "--max-running", "2"],
               env={"FAKE_VLLM_TOKEN_DELAY": "0.05", "FAKE_VLLM_MAX_NUM_SEQS": "2"})
    wait_until(lambda: v.ready()["state"] == "ready", 60, "the model ready")
    port = free_port()
    data = tmp_path / "open-webui"
    data.mkdir()
    env = {**os.environ, "DATA_DIR": str(data), "OLLAMA_BASE_URL": v.url, "ENABLE_OLLAMA_API": "true",
           "ENABLE_OPENAI_API": "false", "ENABLE_FORWARD_USER_INFO_HEADERS": "true", "BYPASS_MODEL_ACCESS_CONTROL": "true",
           "ENABLE_TITLE_GENERATION": "false", "ENABLE_TAGS_GENERATION": "false", "ENABLE_FOLLOW_UP_GENERATION": "false",
           "WEBUI_ADMIN_EMAIL": EMAIL, "WEBUI_ADMIN_PASSWORD": PASSWORD, "WEBUI_SECRET_KEY": "vllama-test-secret",
           "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "ANONYMIZED_TELEMETRY": "false",
           "DO_NOT_TRACK": "true", "SCARF_NO_ANALYTICS": "true", "RAG_EMBEDDING_ENGINE": "ollama"}
    log = (tmp_path / "open-webui.log").open("wb")
    proc = subprocess.Popen([OPEN_WEBUI, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=data,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, f"open-webui exited {proc.returncode}; see {tmp_path / 'open-webui.log'}"
        try:
            return urllib.request.urlopen(url + "/health", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_until(healthy, 240, "Open WebUI to start", interval=0.5)
        admin = _api(url, "POST", "/api/v1/auths/signin", body={"email": EMAIL, "password": PASSWORD})["token"]
        # the one key every user's requests carry (Admin Settings > Connections > Ollama: its key)
        _api(url, "POST", "/ollama/config/update", admin, {"ENABLE_OLLAMA_API": True, "OLLAMA_BASE_URLS": [v.url],
                                                           "OLLAMA_API_CONFIGS": {"0": {"key": "sk-webui"}}})
        _api(url, "POST", "/api/v1/auths/add", admin,
             {"name": "Bob", "email": SECOND_EMAIL, "password": SECOND_PASSWORD, "role": "user"})
        yield v, url
    finally:
        stop(proc, timeout=20)
        log.close()


def test_two_signed_in_users_behind_one_key_one_floods_the_other_still_chats(open_webui_two_users, tmp_path):
    """The admin floods the model with 10 long chats (Open WebUI's own /ollama/api/chat, as its UI sends them, with
    its session: the key and X-OpenWebUI-User-Id); Bob, signed in in Chromium, chats meanwhile. vllama's fair queue
    gives Bob the first place the flood frees (each flood answer 10 s; behind the key's first-come queue Bob would
    wait for 4 rounds of them), and the ledger names both users under the one key."""
    import concurrent.futures as cf
    from playwright import sync_api
    v, base = open_webui_two_users
    qwen = fake_url(v, "qwen-fake")
    admin = _api(base, "POST", "/api/v1/auths/signin", body={"email": EMAIL, "password": PASSWORD})
    flood_body = {"model": "qwen-fake:latest", "stream": False,
                  "messages": [{"role": "user", "content": "flood [[tokens:200]]"}]}
    with cf.ThreadPoolExecutor(10) as ex:
        flood = [ex.submit(_api, base, "POST", "/ollama/api/chat", admin["token"], flood_body) for _ in range(10)]
        wait_until(lambda: get_json(qwen + "/_fake/stats")["running"] == 2, 60, "the flood to fill both places")
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            expect = sync_api.expect
            page.goto(base + "/auth", wait_until="networkidle")
            page.get_by_placeholder("Enter Your Email").fill(SECOND_EMAIL)
            page.get_by_placeholder("Enter Your Password").fill(SECOND_PASSWORD)
            page.get_by_role("button", name="Sign in").click()
            expect(page.locator("#chat-input")).to_be_visible(timeout=30_000)
            try:  # the release notes pop up on a first sign-in
                page.get_by_role("button", name="Okay, Let's Go!").click(timeout=5_000)
            except sync_api.TimeoutError:
                pass
            page.get_by_role("button", name=re.compile("^Selected model")).first.click()
            page.get_by_role("listbox", name="Available models").get_by_role(
                "option", name="Select qwen-fake:latest model").click()
            ended = get_json(qwen + "/_fake/stats")["completed"]
            box = page.locator("#chat-input")
            box.click()
            box.fill("Bob's question [[tokens:8]]")
            page.keyboard.press("Enter")
            asked = time.monotonic()
            # one flood answer takes 10 s: Bob's answer comes once the first of them ends, not after 4 rounds
            expect(page.locator("#response-content-container").last).to_contain_text("tok7", timeout=25_000)
            bob_wait = time.monotonic() - asked
            page.screenshot(path=str(tmp_path / "bob-answered-during-the-flood.png"))
            browser.close()
        for f in flood:
            f.result()
    sent = [r["body"]["messages"][-1]["content"] for r in get_json(qwen + "/_fake/requests")
            if r["path"] == "/v1/chat/completions"]
    bob = next(i for i, c in enumerate(sent) if c.startswith("Bob's question"))
    assert bob <= 2 + ended + 1, (bob, ended, sent)  # at the first place freed, ahead of the 8 flood requests waiting
    usage = _api(v.url, "GET", "/api/usage?by=user", "sk-ops")["usage"]
    users = {r["end_user"]: r["requests"] for r in usage if r["key"] == "webui"}
    bob_id = _api(base, "POST", "/api/v1/auths/signin", body={"email": SECOND_EMAIL, "password": SECOND_PASSWORD})["id"]
    assert users.get(admin["id"], 0) >= 10 and users.get(bob_id, 0) >= 1, users
    chats = [r for r in access_log(v) if r["path"] == "/api/chat"]
    flood_s = sorted(r["duration_ms"] / 1000 for r in chats if r.get("end_user") == admin["id"])
    bob_s = [r["duration_ms"] / 1000 for r in chats if r.get("end_user") == bob_id]
    print(f"\nBob: Enter -> answer on screen {bob_wait:.1f} s (vllama: {', '.join(f'{d:.1f}' for d in bob_s)} s), sent upstream "
          f"{bob + 1}th of {len(sent)} with {ended} flood answers ended when he asked; the flood's 10 answers took "
          f"{', '.join(f'{d:.1f}' for d in flood_s)} s; ledger by user under key 'webui': {users}")
