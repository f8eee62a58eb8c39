"""A model's next start is fast (issue 28): vLLM's compile cache where it survives a restart, and
on-demand models that sleep instead of stopping when host RAM allows.

The end-to-end tests run ``vllama serve`` with nothing configured (``conftest.OnDemandServer``), the
stand-in vLLM, and one GPU that ``tests/fake_nvml`` makes NVML report.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from conftest import TESTS, place
from vllama_proxy.supervisor.warm import compile_cache, sleep_choice

GiB = 1024**3
ONE_GPU = {"PYTHONPATH": os.pathsep.join([str(TESTS / "fake_nvml"), os.environ.get("PYTHONPATH", "")]),
           "FAKE_NVML_GPUS": "80:79"}


def test_compile_cache_given_default_or_state_dir(tmp_path):
    state = tmp_path / "state"
    assert compile_cache(state, {"VLLM_CACHE_ROOT": "/data/vllm", "HOME": str(tmp_path)}) == (
        Path("/data/vllm"), "VLLM_CACHE_ROOT", {})
    # vLLM's own default when it can be written: XDG_CACHE_HOME first, then ~/.cache
    path, why, env = compile_cache(state, {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)})
    assert (path, env) == (tmp_path / "xdg" / "vllm", {}) and "default" in why
    path, _, env = compile_cache(state, {"HOME": str(tmp_path / "home")})
    assert (path, env) == (tmp_path / "home" / ".cache" / "vllm", {})
    # a home that cannot be written (here: below a regular file; systemd's DynamicUser, a read-only root)
    (tmp_path / "file").write_text("")
    path, why, env = compile_cache(state, {"HOME": str(tmp_path / "file" / "home")})
    assert (path, env) == (state / "vllm-cache", {"VLLM_CACHE_ROOT": str(state / "vllm-cache"),
                                                  "TRITON_CACHE_DIR": str(state / "vllm-cache" / "triton")})
    assert "not writable" in why
    _, _, env = compile_cache(state, {"HOME": str(tmp_path / "file" / "home"), "TRITON_CACHE_DIR": "/t"})
    assert env == {"VLLM_CACHE_ROOT": str(state / "vllm-cache")}  # a given Triton cache is kept


def test_sleep_choice_from_ram_weights_and_gpus():
    assert sleep_choice(3 * GiB, 64 * GiB, 4 * GiB, gpus=1)[0]
    on, why = sleep_choice(3 * GiB, 6 * GiB, 4 * GiB, gpus=1)
    assert not on and "6.0 GiB < weights 3.0 GiB + reserve 4.0 GiB" in why
    on, why = sleep_choice(3 * GiB, 64 * GiB, 4 * GiB, gpus=0)
    assert not on and "CUDA" in why


def _log(s) -> list[dict]:
    return [json.loads(x) for x in s.log.read_text().splitlines() if x.startswith("{")]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_on_demand_models_sleep_by_default_and_the_cache_is_kept(serve, hub, tmp_path):
    for repo in ("acme/tiny-a", "acme/tiny-b"):
        place(hub, repo)
    (tmp_path / "file").write_text("")
    # 0.6 each: the two never fit together, so B takes A's GPU room and A's is given back
    s = serve("--keep-alive", "-1", "--", "--gpu-memory-utilization", "0.6",
              env={**ONE_GPU, "HOME": str(tmp_path / "file" / "home"), "XDG_CACHE_HOME": ""})
    ask = lambda m: s.client.generate(model=m, prompt="x", options={"num_predict": 1}).done  # noqa: E731
    assert ask("acme/tiny-a") and ask("acme/tiny-b")
    assert {m["model"]: m["state"] for m in httpx.get(s.url + "/readyz").json()["models"]} == {
        "acme/tiny-a": "sleeping", "acme/tiny-b": "ready"}
    assert ask("acme/tiny-a")  # A -> B -> A: woken, not started again
    assert [a[2] for a in s.launched()] == ["acme/tiny-a", "acme/tiny-b"]
    assert all("--enable-sleep-mode" in a for a in s.launched())
    log = _log(s)
    decided = [x for x in log if x.get("event") == "on_demand_sleep"]
    assert [(x["model"], x["sleep"]) for x in decided] == [("acme/tiny-a", True), ("acme/tiny-b", True)]
    assert "holds the weights" in decided[0]["reason"]
    # the compile cache: home is not writable, so vLLM's goes under the state directory, for every vLLM
    cache = [x for x in log if x.get("event") == "compile_cache"]
    assert cache and cache[0]["path"] == str(s.state / "vllm-cache")
    pids = [x["pid"] for x in log if x.get("event") == "launched"]
    env = _environ(pids[-1])
    assert env["VLLM_CACHE_ROOT"] == str(s.state / "vllm-cache") and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["TRITON_CACHE_DIR"] == str(s.state / "vllm-cache" / "triton")


def test_no_sleep_when_turned_off_or_without_ram_or_gpu(serve, hub):
    for repo in ("acme/tiny-a", "acme/tiny-b"):
        place(hub, repo)
    s = serve("--keep-alive", "-1", "--no-on-demand-sleep", "--", "--gpu-memory-utilization", "0.6", env=ONE_GPU)
    ask = lambda m: s.client.generate(model=m, prompt="x", options={"num_predict": 1}).done  # noqa: E731
    assert ask("acme/tiny-a") and ask("acme/tiny-b") and ask("acme/tiny-a")
    assert [a[2] for a in s.launched()] == ["acme/tiny-a", "acme/tiny-b", "acme/tiny-a"]  # stopped and started again
    assert not any("--enable-sleep-mode" in a for a in s.launched())
    assert {x["reason"] for x in _log(s) if x.get("event") == "on_demand_sleep"} == {"--no-on-demand-sleep"}
    s.proc.terminate()
    s.proc.wait(20)
    # RAM short (a reserve larger than any host's), and no GPU (vLLM on CPU has no sleep mode)
    for flags, env, why in ((("--sleep-host-memory-reserve", str(1 << 50)), ONE_GPU, "host RAM available"),
                            ((), {}, "no GPU counted")):
        s = serve("--keep-alive", "-1", *flags, env=env)
        assert s.client.generate(model="acme/tiny-a", prompt="x", options={"num_predict": 1}).done
        assert not any("--enable-sleep-mode" in a for a in s.launched())
        decided = [x for x in _log(s) if x.get("event") == "on_demand_sleep"]
        assert len(decided) == 1 and not decided[0]["sleep"] and why in decided[0]["reason"]
        s.proc.terminate()
        s.proc.wait(20)


def test_an_on_demand_model_that_will_sleep_sleeps_and_wakes_once_before_it_is_ready(serve, hub, tmp_path):
    """Issue 28: vLLM's first sleep of a model is slow (2.0 s on the H200, later ones 0.15 s), so a
    freshly started on-demand model that will sleep does one sleep and wake before it is ready,
    once per start; a request arriving meanwhile waits and is answered; its status says so."""
    import ollama

    for repo in ("acme/tiny-a", "acme/tiny-b"):
        place(hub, repo)
    ledger, gate = tmp_path / "gpu-ledger.json", tmp_path / "sleep-gate"
    s = serve("--keep-alive", "-1", "--", "--gpu-memory-utilization", "0.6",
              env={**ONE_GPU, "FAKE_VLLM_GPU_LEDGER": str(ledger), "FAKE_VLLM_SLEEP_SECONDS": "1.0",
                   "FAKE_VLLM_SLEEP_GATE": str(gate)})  # the first sleep lasts until the test has seen it

    def ask(model: str) -> bool:  # a client of its own: two ask at once
        return ollama.Client(host=s.url, timeout=60).generate(model=model, prompt="x", options={"num_predict": 1}).done

    def status(model: str) -> dict:
        models = httpx.get(s.url + "/readyz").json().get("models", [])
        return next((m for m in models if m["model"] == model), {})

    def note(model: str) -> str:
        return status(model).get("last_error") or ""

    with ThreadPoolExecutor(2) as threads:
        first = threads.submit(ask, "acme/tiny-a")
        deadline = time.monotonic() + 30
        while "warming its sleep" not in note("acme/tiny-a"):
            assert time.monotonic() < deadline and not first.done()
            time.sleep(0.02)
        second = threads.submit(ask, "acme/tiny-a")  # arrives during the cycle: waits for it
        while status("acme/tiny-a").get("waiting", 0) < 2:  # both wait for the model (the sleep is gated)
            assert time.monotonic() < deadline and not first.done()
            time.sleep(0.02)
        gate.touch()
        assert first.result() and second.result()
    assert note("acme/tiny-a") == ""
    assert ask("acme/tiny-b") and ask("acme/tiny-a")  # A -> B -> A: B warmed once too; A woken, not warmed again
    events = json.loads(ledger.read_text())["events"]
    assert [e[0] for e in events] == ["start", "sleep", "wake",  # A: its start's cycle
                                      "sleep", "start", "sleep", "wake",  # A evicted (asleep), B started and warmed
                                      "sleep", "wake"]  # B evicted, A woken
    warmed = [x for x in _log(s) if x.get("event") == "sleep_warmed"]
    assert [x["model"] for x in warmed] == ["acme/tiny-a", "acme/tiny-b"]
    assert all(x["sleep_s"] >= 1.0 and x["wake_s"] > 0 for x in warmed)
    s.proc.terminate()
    s.proc.wait(20)
    # a model that will not sleep (stopped instead) is not warmed
    s = serve("--keep-alive", "-1", "--no-on-demand-sleep", env={**ONE_GPU, "FAKE_VLLM_GPU_LEDGER": str(tmp_path / "l2.json")})
    assert ask("acme/tiny-a")
    assert [e[0] for e in json.loads((tmp_path / "l2.json").read_text())["events"]] == ["start"]
    assert not [x for x in _log(s) if x.get("event") == "sleep_warmed"]
