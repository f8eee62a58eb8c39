"""``vllama batch``: mixed files, invalid lines, 503 retries, resume after SIGKILL / SIGINT.

Everything runs against a real ``vllama serve`` process in front of the fake vLLM; the
interruption tests run the batch itself as a separate process and kill it.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
import pytest

from conftest import ALIAS, ROOT, SERVED, get_json, start_fake, start_proxy, stop
from vllama_proxy.client import batch
from vllama_proxy.client.batch import BatchError, main, run_batch, scan_output, server_url

EIGHT = "".join(f"tok{i} " for i in range(8))
BATCH_CMD = [sys.executable, "-c", "import sys; from vllama_proxy.client.batch import main; sys.exit(main(sys.argv[1:]))"]


def write_jsonl(path: Path, lines: list) -> Path:
    """Objects are dumped as JSON, strings written as they are (for invalid lines)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_results(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "partial last line"
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def by_custom_id(results: list[dict]) -> dict[str, dict]:
    counts = Counter(r["custom_id"] for r in results if r["custom_id"] is not None)
    assert max(counts.values(), default=1) == 1, [c for c, n in counts.items() if n > 1]
    return {r["custom_id"]: r for r in results if r["custom_id"] is not None}


def chat_line(cid: str, text: str = "hi", **extra) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": SERVED, "messages": [{"role": "user", "content": text}], **extra}}


def clear_fake(fake_url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(fake_url + "/_fake/requests", method="DELETE"), timeout=5)


def sent_ids(fake_url: str) -> list[str]:
    """custom ids (``item-N`` words in the prompt) of the chat requests the fake received."""
    out = []
    for r in get_json(fake_url + "/_fake/requests"):
        if r["path"] == "/v1/chat/completions":
            out.append(r["body"]["messages"][-1]["content"].split()[0])
    return out


async def test_mixed_file(proxy, upstream_requests, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        chat_line("chat", "hi from-the-chat-line", stream=True, stream_options={"include_usage": True}),
        {"custom_id": "compl", "method": "POST", "url": "/v1/completions",
         "body": {"model": ALIAS, "prompt": "hi [[tokens:3]]"}},
        {"custom_id": "gen", "method": "POST", "url": "/api/generate", "body": {"model": ALIAS, "prompt": "hi"}},
        {"custom_id": "ochat", "url": "/api/chat",
         "body": {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "stream": True}},
        "this is not json",
        "",
        {"custom_id": "badurl", "method": "POST", "url": "/v1/responses", "body": {}},
        {"custom_id": "badmethod", "method": "GET", "url": "/api/chat", "body": {}},
        {"url": "/api/chat", "body": {}},
        chat_line("chat", "again"),  # repeated custom_id
        {"custom_id": "nomodel", "url": "/v1/chat/completions",
         "body": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "nomodel-ollama", "url": "/api/generate", "body": {"model": "nope", "prompt": "hi"}},
        chat_line("e400", "hi [[fault:http400]]"),
    ])
    out = tmp_path / "out.jsonl"
    s = await run_batch(inp, out, host=proxy.url, concurrency=4)
    assert (s.total, s.ok, s.failed, s.invalid, s.remaining, s.interrupted) == (12, 4, 3, 5, 0, False)
    assert s.output_tokens == 8 + 3 + 8 + 8

    results = read_results(out)
    assert len(results) == 12
    assert len({r["id"] for r in results}) == 12
    r = by_custom_id(results)
    assert set(r) == {"chat", "compl", "gen", "ochat", "badurl", "badmethod", "nomodel", "nomodel-ollama", "e400"}
    for cid in ("chat", "compl", "gen", "ochat"):
        assert r[cid]["response"]["status_code"] == 200 and r[cid]["error"] is None, r[cid]
    assert r["chat"]["id"] == "batch_req_1"
    assert r["chat"]["response"]["body"]["choices"][0]["message"]["content"] == EIGHT
    assert r["compl"]["response"]["body"]["choices"][0]["text"] == "tok0 tok1 tok2 "
    assert r["gen"]["response"]["body"]["response"] == EIGHT and r["gen"]["response"]["body"]["done"] is True
    assert r["ochat"]["response"]["body"]["message"]["content"] == EIGHT
    for cid in ("badurl", "badmethod"):
        assert r[cid]["response"] is None and r[cid]["error"]["code"] == "invalid_line"
    assert r["nomodel"]["response"]["status_code"] == 404 and r["nomodel"]["error"]["code"] == "http_error"
    assert r["nomodel-ollama"]["response"]["status_code"] == 404
    assert r["nomodel-ollama"]["error"]["message"].startswith("model 'nope' not found: ")
    assert r["e400"]["response"]["status_code"] == 400
    assert "maximum context length" in r["e400"]["error"]["message"]
    anonymous = {x["id"]: x for x in results if x["custom_id"] is None}
    assert set(anonymous) == {"batch_req_5", "batch_req_9", "batch_req_10"}  # line 6 is blank
    assert "invalid JSON" in anonymous["batch_req_5"]["error"]["message"]
    assert "'chat' repeats" in anonymous["batch_req_10"]["error"]["message"]
    assert all(x["response"] is None and x["error"]["code"] == "invalid_line" for x in anonymous.values())

    # Generation went out non-streamed; the OpenAI line lost its stream options.
    sent = [q["body"] for q in upstream_requests("/v1/chat/completions")
            if q["body"]["messages"][0]["content"] == "hi from-the-chat-line"]
    assert len(sent) == 1 and sent[0]["stream"] is False and "stream_options" not in sent[0]

    # A second run has nothing to do and contacts nobody.
    s2 = await run_batch(inp, out, host="http://127.0.0.1:1")
    assert (s2.skipped, s2.written, s2.remaining) == (12, 0, 0)
    assert read_results(out) == results


async def test_embeddings(embed_proxy, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "oai", "method": "POST", "url": "/v1/embeddings", "body": {"model": SERVED, "input": ["a", "b"]}},
        {"custom_id": "ollama", "method": "POST", "url": "/api/embed", "body": {"model": ALIAS, "input": "a"}},
    ])
    out = tmp_path / "out.jsonl"
    s = await run_batch(inp, out, host=embed_proxy.url)
    assert (s.ok, s.remaining) == (2, 0)
    r = by_custom_id(read_results(out))
    assert len(r["oai"]["response"]["body"]["data"]) == 2
    assert len(r["ollama"]["response"]["body"]["embeddings"]) == 1


def test_server_busy_is_retried(fake, tmp_path):
    p = start_proxy(fake.url, "--max-running", "1", "--max-queue", "0", "--retry-after", "0")
    try:
        inp = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"c{i}", f"item-{i} [[tokens:3]]") for i in range(12)])
        out = tmp_path / "out.jsonl"
        # No retries: the requests beyond the one slot get a final 503 server busy.
        assert main([str(inp), "-o", str(out), "--host", p.url, "-c", "4", "--retries", "0", "-q"]) == 0
        busy = [x for x in read_results(out) if x["error"]]
        assert busy, "4 concurrent requests against 1 slot: some must be refused"
        assert all(x["response"]["status_code"] == 503 and "server busy" in x["error"]["message"] for x in busy)
        # --retry-failed sends those again, and with retries everything gets through.
        args = [str(inp), "-o", str(out), "--host", p.url, "-c", "4", "--retries", "50", "--retry-backoff", "0.01", "-q"]
        assert main([*args, "--retry-failed"]) == 0
        r = by_custom_id(read_results(out))
        assert len(r) == 12 and all(x["response"]["status_code"] == 200 and x["error"] is None for x in r.values())
        # And from scratch: every line succeeds, some only after a retry.
        s = asyncio.run(run_batch(inp, out, host=p.url, concurrency=4, retries=50, retry_backoff=0.01, restart=True))
        assert (s.ok, s.failed, s.remaining) == (12, 0, 0) and s.retries > 0
        assert len(by_custom_id(read_results(out))) == 12
    finally:
        stop(p.proc)


@pytest.fixture(scope="module")
def slow_stack(model_dir):
    """A fake vLLM taking 10 ms per token (80 ms per request) behind its own proxy."""
    f = start_fake(model_dir, env={"FAKE_VLLM_TOKEN_DELAY": "0.01"})
    p = start_proxy(f.url)
    yield f, p
    stop(p.proc)
    stop(f.proc)


def wait_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the batch finished before it could be interrupted"
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.01)
    raise TimeoutError(f"{path}: fewer than {n} lines")


def settle(fake_url: str, proxy_port: int | None = None) -> None:
    """Wait until a dead client's requests are over: the proxy at ``proxy_port`` has closed each of its client
    connections (a request it read after the kill still reached the fake: on a busy machine, after the fake had
    nothing in flight) and the fake has nothing in flight (the requests were aborted)."""
    deadline = time.monotonic() + 120
    while True:
        clients = [c for c in psutil.net_connections("tcp") if proxy_port is not None and c.laddr
                   and c.laddr.port == proxy_port and c.status in ("ESTABLISHED", "CLOSE_WAIT", "SYN_RECV")]
        if not clients and not get_json(fake_url + "/_fake/stats")["in_flight"]:
            return
        assert time.monotonic() < deadline, (clients, get_json(fake_url + "/_fake/stats"))
        time.sleep(0.02)


def test_resume_after_sigkill(slow_stack, tmp_path):
    fake, proxy = slow_stack
    n = 300
    inp = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"c{i}", f"item-{i} hello") for i in range(n)])
    out = tmp_path / "out.jsonl"
    clear_fake(fake.url)
    proc = subprocess.Popen([*BATCH_CMD, str(inp), "-o", str(out), "--host", proxy.url, "-c", "16"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_lines(out, 60, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        stop(proc)
    first = read_results(out)  # whole lines only, even after SIGKILL
    assert 60 <= len(first) < n
    done = set(by_custom_id(first))
    settle(fake.url, proxy.port)
    first_sent = sent_ids(fake.url)
    assert {f"item-{c[1:]}" for c in done} <= set(first_sent)
    # A torn last line, as a crash in the middle of a write (or a power loss) leaves it.
    with out.open("ab") as f:
        f.write(b'{"id": "batch_req_999", "custom_id": "c2')
    clear_fake(fake.url)

    assert main([str(inp), "-o", str(out), "--host", proxy.url, "-c", "16", "-q"]) == 0

    results = read_results(out)
    assert results[: len(first)] == first
    r = by_custom_id(results)
    assert set(r) == {f"c{i}" for i in range(n)} and len(results) == n
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["choices"][0]["message"]["content"] == EIGHT
               for x in r.values())
    assert all(r[f"c{i}"]["id"] == f"batch_req_{i + 1}" for i in range(n))
    # The second run sent exactly the lines without a result, each once.
    resent = sent_ids(fake.url)
    assert sorted(resent) == sorted(f"item-{i}" for i in range(n) if f"c{i}" not in done)


def test_sigint_flushes_and_exits_130(slow_stack, tmp_path):
    fake, proxy = slow_stack
    n = 200
    inp = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"c{i}", f"item-{i}") for i in range(n)])
    out = tmp_path / "out.jsonl"
    err = tmp_path / "stderr.txt"
    with err.open("wb") as e:
        proc = subprocess.Popen([*BATCH_CMD, str(inp), "-o", str(out), "--host", proxy.url, "-c", "8"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=e)
        try:
            wait_lines(out, 20, proc)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(10) == 130
        finally:
            stop(proc)
    assert "interrupted" in err.read_text()
    first = by_custom_id(read_results(out))
    assert 20 <= len(first) < n
    assert main([str(inp), "-o", str(out), "--host", proxy.url, "-c", "32", "-q"]) == 0
    assert set(by_custom_id(read_results(out))) == {f"c{i}" for i in range(n)}


def test_usage_errors(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [chat_line("a")])
    assert main([str(inp)]) == 1  # no -o
    assert main([str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 1
    assert main([str(inp), "-o", str(inp)]) == 1
    assert main([str(inp), "-o", str(tmp_path / "o.jsonl"), "-c", "0"]) == 1
    # Nothing listens on port 1: stop before writing anything.
    assert main([str(inp), "-o", str(tmp_path / "o.jsonl"), "--host", "127.0.0.1:1"]) == 1
    assert "cannot reach" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists() or read_results(tmp_path / "o.jsonl") == []
    # An output that is not a results file is refused rather than appended to.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "batch_req_1", "custom_id": "a"}\nhello\n')
    with pytest.raises(BatchError, match="not a result line"):
        scan_output(bad)
    assert main([str(inp), "-o", str(bad), "--host", "127.0.0.1:1"]) == 1
    assert main(["--help"]) == 0


def test_api_key(fake, tmp_path, monkeypatch):
    p = start_proxy(fake.url, "--api-key", "sekrit")
    try:
        inp = write_jsonl(tmp_path / "in.jsonl", [chat_line("a")])
        out = tmp_path / "out.jsonl"
        assert main([str(inp), "-o", str(out), "--host", p.url, "--api-key", "wrong", "-q"]) == 1
        monkeypatch.setenv("OLLAMA_API_KEY", "sekrit")
        monkeypatch.setenv("OLLAMA_HOST", p.url)
        assert main([str(inp), "-o", str(out), "-q"]) == 0
        assert by_custom_id(read_results(out))["a"]["response"]["status_code"] == 200
    finally:
        stop(p.proc)


def test_scan_output_truncates_partial_line(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"id": "batch_req_1", "custom_id": "a", "response": null, "error": null}\n'
                    b'{"id": "batch_req_2", "custom_id": null, "response": null, "error": {"code": "invalid_line"}}\n'
                    b'{"id": "batch_req_3", "cus')
    assert scan_output(out) == {("c", "a"), ("i", "batch_req_2")}
    assert out.read_bytes().endswith(b"}\n") and out.read_bytes().count(b"\n") == 2
    assert scan_output(tmp_path / "missing.jsonl") == set()


@pytest.mark.parametrize("value,url", [
    (None, "http://127.0.0.1:11434"),
    ("", "http://127.0.0.1:11434"),
    ("0.0.0.0", "http://0.0.0.0:11434"),
    (":8080", "http://127.0.0.1:8080"),
    ("example.com:1234", "http://example.com:1234"),
    ("https://example.com", "https://example.com:443"),
    ("http://[::1]:9000/base/", "http://[::1]:9000/base"),
])
def test_server_url(value, url, monkeypatch):
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    assert server_url(value) == url


def test_server_url_rejects():
    with pytest.raises(BatchError):
        server_url("ftp://x")
    with pytest.raises(BatchError):
        server_url("host:99999")


# --------------------------------------------------------------------------- concurrency and progress (issue 28)


class Tty(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def peak_in_flight(fake_url: str, done: threading.Event) -> list[int]:
    """Sample the fake's requests in flight every 10 ms until ``done``; returns the samples (in a list filled by a thread)."""
    samples: list[int] = []

    def sample() -> None:
        while not done.is_set():
            samples.append(get_json(fake_url + "/_fake/stats")["in_flight"])
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    return samples


def test_concurrency_follows_the_server(slow_stack, model_dir, tmp_path):
    fake, _ = slow_stack
    p = start_proxy(fake.url, "--max-running", "8")
    try:
        assert get_json(p.url + "/api/version")["max_running"] == 8
        inp = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"c{i}", f"item-{i} [[tokens:20]]") for i in range(40)])
        settle(fake.url)
        done = threading.Event()
        samples = peak_in_flight(fake.url, done)
        err = io.StringIO()
        try:
            s = asyncio.run(run_batch(inp, tmp_path / "out.jsonl", host=p.url, progress=err))
        finally:
            done.set()
        assert (s.ok, s.remaining) == (40, 0)
        assert "concurrency 16: the server runs 8 requests at once" in err.getvalue()
        # 8 running + as many queued in vLLM (issue 42; a quarter before), never the old default 64
        assert max(samples) == 16, samples
    finally:
        stop(p.proc)


def test_concurrency_fallback_when_the_server_does_not_say(proxy, tmp_path):
    # --upstream without --max-running or --max-num-seqs: vllama does not know, and does not guess aloud
    assert "max_running" not in get_json(proxy.url + "/api/version")
    inp = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"c{i}") for i in range(3)])
    err = io.StringIO()
    s = asyncio.run(run_batch(inp, tmp_path / "out.jsonl", host=proxy.url, progress=err))
    assert s.ok == 3
    assert "concurrency 64: the server does not say" in err.getvalue()
    # an explicit --concurrency is not overridden, and not announced
    err = io.StringIO()
    asyncio.run(run_batch(inp, tmp_path / "out2.jsonl", host=proxy.url, progress=err, concurrency=2))
    assert "concurrency" not in err.getvalue()


def test_max_running_with_max_num_seqs(fake):
    # told after --: 16 x data parallel 2 (vLLM's arguments, as a supervised model's)
    p = start_proxy(fake.url, vllm_args=["--max-num-seqs", "16", "--data-parallel-size", "2"])
    try:
        assert get_json(p.url + "/api/version")["max_running"] == 32
    finally:
        stop(p.proc)


def test_progress_bar_on_a_terminal(slow_stack, tmp_path):
    fake, proxy = slow_stack
    inp = write_jsonl(tmp_path / "in.jsonl", ["not json"]
                      + [chat_line(f"c{i}", f"item-{i} [[tokens:30]]") for i in range(8)])
    err = Tty()
    s = asyncio.run(run_batch(inp, tmp_path / "out.jsonl", host=proxy.url, progress=err, concurrency=2))
    assert (s.ok, s.invalid) == (8, 1)
    text = err.getvalue()
    frames = [f for f in text.split("\r") if f.strip()]
    assert any("/9" in f and "ok " in f and "errors 1" in f and "tok/s" in f for f in frames), frames
    assert any(re.search(r"\[\d\d:\d\d<\d\d:\d\d", f) for f in frames), frames  # tqdm's elapsed<ETA
    assert "vllama batch: 0/" not in text  # not the plain log lines


def test_progress_lines_when_not_a_terminal(slow_stack, tmp_path, monkeypatch):
    fake, proxy = slow_stack
    monkeypatch.setattr(batch.progress, "PLAIN_INTERVAL", 0.1)
    inp = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"c{i}", f"item-{i} [[tokens:30]]") for i in range(6)])
    err = io.StringIO()
    s = asyncio.run(run_batch(inp, tmp_path / "out.jsonl", host=proxy.url, progress=err, concurrency=2))
    assert s.ok == 6
    lines = [ln for ln in err.getvalue().splitlines() if "/6 (" in ln]
    assert lines and all(re.fullmatch(r"vllama batch: \d/6 \(.*\)  ok \d  errors 0  .* req/s  \d+ tok/s  ETA \S+", ln)
                         for ln in lines), err.getvalue()
    assert "\r" not in err.getvalue() and "\x1b" not in err.getvalue()
