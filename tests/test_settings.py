"""Settings: precedence, OLLAMA_HOST, the `--` pass-through, and the settings table of docs/configuration.md staying true."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, resolved_specs
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
    # nothing to serve: no model, no upstream, and on-demand models off (plain `vllama serve` serves
    # local models on demand, as `ollama serve`)
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--no-on-demand"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "--upstream" in r.stderr


def test_settings_table_is_current():
    table = subprocess.run([sys.executable, "scripts/settings_table.py"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert table.strip() in page, "the settings table is stale: run scripts/settings_table.py --update docs/configuration.md"


# --- the config file (--config / VLLAMA_CONFIG) ---------------------------------------------

EXAMPLE = ROOT / "deploy" / "vllama.example.toml"


def test_the_example_config_is_valid():
    s = load_settings(["--config", str(EXAMPLE)])
    specs = resolved_specs(s)
    assert [m.served_name for m in specs] == ["qwen2.5-7b", "qwen3-8b", "bge-m3", "llama3.3-70b"]
    qwen = specs[0]
    assert qwen.args()[:7] == ["--gpu-memory-utilization", "0.45", "--max-model-len", "32768",
                               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert "--enable-sleep-mode" in qwen.args() and qwen.args()[-3:] == ["--max-num-seqs", "256", "--enable-prefix-caching"]
    assert qwen.env() == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"} and qwen.gpu_ids == (0,)
    llama = specs[3]
    assert llama.gpu_ids == (1, 2) and llama.gpu_share == 0.9 and not llama.preload and not llama.sleeps
    # the shares the example puts on GPU 0 fit together
    assert sum(m.gpu_share for m in specs if 0 in m.gpu_ids) <= 1.0
    assert s.keep_alive == "30m" and s.host == "0.0.0.0"


def test_config_file_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "v.toml"
    cfg.write_text('port = 1111\nkeep_alive = "2m"\nlog_level = "DEBUG"\n[[models]]\nmodel = "/m"\n')
    monkeypatch.setenv("VLLAMA_CONFIG", str(cfg))
    monkeypatch.setenv("VLLAMA_KEEP_ALIVE", "3m")
    s = load_settings(["--log-level", "WARNING"])
    assert (s.port, s.keep_alive, s.log_level) == (1111, "3m", "WARNING")  # flags > environment > file
    assert [m.model for m in resolved_specs(s)] == ["/m"]


@pytest.mark.parametrize("text,message", [
    ('prot = 1\n', "unknown setting(s) prot"),
    ('[[models]]\nmodel = "a"\ngpu = [0]\n', "models.0.gpu: Extra inputs are not permitted"),
    ('[[models]]\nmodel = "a"\nvllm_args = ["--port", "1"]\n', "--port is set by vllama"),
    ('[[models]]\nmodel = "a"\ngpu_memory_utilization = 0.5\nvllm_args = ["--gpu-memory-utilization=0.4"]\n',
     "--gpu-memory-utilization is given both as a field and in vllm_args"),
    ('[[models]]\nmodel = "a"\ntensor_parallel_size = 2\ngpus = [3]\n', "gpus lists 1 GPUs but the model needs 2"),
    ('[[models]]\nmodel = "a"\ngpu_memory_utilization = 1.5\n', "less than or equal to 1"),
    ('[[models]]\nmodel = "a"\n[[models]]\nmodel = "b"\naliases = ["A:latest"]\n', "model name 'A:latest' is used twice"),
    ('upstream = "http://x:1"\n[[models]]\nmodel = "a"\n', "--upstream proxies a running vLLM"),
    ('[[models\nmodel = "a"\n', "v.toml"),
])
def test_config_file_errors_exit_2(tmp_path, text, message):
    cfg = tmp_path / "v.toml"
    cfg.write_text(text)
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_model_and_models_are_exclusive(tmp_path):
    cfg = tmp_path / "v.toml"
    cfg.write_text('[[models]]\nmodel = "a"\n')
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--config", str(cfg), "--model", "b"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "either --model or [[models]]" in r.stderr
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--config", str(tmp_path / "none.toml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "not found" in r.stderr


# --- the settings package: names kept, cross-field rules that refuse or derive ------------------


def test_flags_and_variables_unchanged():
    """Every flag of ``vllama serve`` and every ``VLLAMA_*`` variable, as the one-class settings.py had
    them (tests/fixtures/settings_names.txt, generated from it): the field groups renamed nothing."""
    from vllama_proxy.settings import Settings, cli_source

    parser = cli_source([]).root_parser
    flags = sorted({o for a in parser._actions for o in a.option_strings})
    variables = sorted(f"VLLAMA_{n.upper()}" for n in Settings.model_fields)
    assert flags + variables == (ROOT / "tests" / "fixtures" / "settings_names.txt").read_text().split()


def test_router_derives_the_upstream_it_does_not_write_it():
    from vllama_proxy.settings import Settings

    s = Settings(router="sticky_least_loaded", router_port=30002)
    assert s.upstream is None and s.upstream_url == "http://127.0.0.1:30002"  # main wrote --upstream
    assert Settings(upstream="http://x:1/").upstream_url == "http://x:1" and Settings().upstream_url is None
    with pytest.raises(ValueError, match="give it without --upstream"):
        Settings(router="round_robin", upstream="http://x:1")


def test_fleet_secret_derives_the_bearer_and_a_nodes_keys():
    from vllama_proxy.settings import Settings

    front = Settings(upstream="http://r:1", fleet_secret="s3")
    assert front.api_key_upstream is None and front.upstream_bearer == "s3"  # main wrote --api-key-upstream
    assert Settings(upstream="http://r:1", fleet_secret="s3", api_key_upstream="v").upstream_bearer == "v"
    node = Settings(register_with="http://r:1", fleet_secret="s3")
    assert node.api_key == [] and node.client_keys == ["s3"]  # main wrote --api-key
    assert Settings(api_key=["a", "b"], fleet_secret="s3").client_keys == ["a", "b"]  # a front keeps its keys
    assert Settings(fleet_secret="").fleet_secret is None and Settings(fleet_secret="").upstream_bearer is None
    with pytest.raises(ValueError, match="is its only key"):
        Settings(register_with="http://r:1", fleet_secret="s3", api_key=["other"])


def test_cross_field_checks_are_pure():
    from vllama_proxy.models.launch_spec import ModelConfig
    from vllama_proxy.settings import checks

    checks.router_alone(None, None, 30000, "m", [])
    checks.router_alone("p", "http://127.0.0.1:30000", 30000, None, [])  # its own URL, as given
    with pytest.raises(ValueError, match="without --model"):
        checks.router_alone("p", None, 30000, "m", [])
    with pytest.raises(ValueError, match="--vllm-port"):
        checks.reserved_vllm_args("m", ["--port=1"])
    checks.reserved_vllm_args(None, ["--port=1"])  # --upstream: the arguments only describe it
    with pytest.raises(ValueError, match="used twice"):
        checks.one_source_of_models(None, [ModelConfig(model="a", port=9), ModelConfig(model="b", port=9)], None, [], 11434)
    with pytest.raises(ValueError, match="choose one"):
        checks.one_source_of_models("m", [], "http://x", [], 11434)
    checks.fleet_node_keys("s", "http://r", None, ["s"])
    with pytest.raises(ValueError, match="only key"):
        checks.fleet_node_keys("s", "http://r", "keys.toml", ["s"])
    assert checks.upstream_url(None, "p", 1) == "http://127.0.0.1:1" and checks.upstream_url("http://u", None, 1) == "http://u"
    assert checks.upstream_bearer(None, "s") == "s" and checks.client_keys(["a"], "s", None) == ["a"]


def test_ollama_variables_fill_only_what_ours_left():
    from vllama_proxy.settings.sources import ollama_variables

    env = {"OLLAMA_HOST": "0.0.0.0:9", "OLLAMA_KEEP_ALIVE": "1h", "OLLAMA_MAX_QUEUE": "5"}
    assert ollama_variables({}, env) == {"host": "0.0.0.0", "port": 9, "keep_alive": "1h", "max_queue": "5"}
    assert ollama_variables({"port": 7, "keep_alive": "1m", "max_queue": 1}, env) == {}
    with pytest.raises(ValueError, match="invalid OLLAMA_KEEP_ALIVE"):
        ollama_variables({}, {"OLLAMA_KEEP_ALIVE": "soon"})


@pytest.mark.parametrize("keys,flags", [
    (None, ["--api-key-file", "missing-keys.toml"]),
    ('[[keys]]\nname = "a"\nkey = "sk-a"\nbudget_tokens = 10\n', ["--usage-db", "off"]),
])
def test_bad_configuration_exits_with_one_line_before_the_app(tmp_path, keys, flags):
    """A keys file that cannot be read, or budgets without the ledger: exit 2 with the one line, before
    anything is built or logged (main said it from inside the app's builder, after the start-up's log)."""
    if keys is not None:
        (tmp_path / "keys.toml").write_text(keys)
        flags = [*flags, "--api-key-file", "keys.toml"]
    r = subprocess.run([sys.executable, "-m", "vllama_proxy", "serve", "--upstream", "http://127.0.0.1:9",
                        "--state-dir", str(tmp_path), "--log-format", "console", *flags],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("vllama serve: "), r.stderr
    assert ("--api-key-file" if keys is None else "budget_tokens") in r.stderr
