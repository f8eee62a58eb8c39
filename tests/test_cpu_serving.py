"""Issue 37.4: serving on the CPU without tricks. Which vLLM build is found (``supervisor/engine.py``)
and the flags chosen from the host's RAM and cores (``supervisor/cpu_serving.py``), with fake numbers;
the real engine serving with no extra flags is ``tests/real_engine/test_real_cpu.py``."""

from __future__ import annotations

import os
import sys

from vllama_proxy.supervisor import cpu_serving, engine
from vllama_proxy.supervisor.cpu_serving import GiB, MiB, choose_host_env, choose_model_flags

#: Qwen2.5-7B in bf16: 57,344 KV bytes per token, 32,768 tokens of context, 15.2 GiB of weights.
QWEN7B = dict(weights=int(15.2 * GiB), kv_per_token=57_344, context=32_768)
#: The shipped tool model: 3,072 bytes per token, 4,096 tokens, 20 MB.
TOOL = dict(weights=20_669_496, kv_per_token=3_072, context=4_096)


def flags(choices):
    return {c.name: c.value for c in choices}


def test_a_small_model_gets_its_whole_context_and_a_cache_for_four_requests_of_it():
    got = flags(choose_model_flags([], available=8 * GiB, environ={}, **TOOL))
    assert got == {"--kv-cache-memory-bytes": str(64 * MiB), "--max-model-len": "4096"}  # 4 x 12 MiB < the 64 MiB floor


def test_a_large_model_on_a_small_host_gets_the_context_its_cache_holds():
    # 20 GiB available: a quarter of (20 - 15.2 - 1.5) GiB = 0.82 GiB of cache, 15,104 tokens of 56 KiB (a multiple of 128)
    choices = choose_model_flags([], available=20 * GiB, environ={}, **QWEN7B)
    got = flags(choices)
    kv = int(got["--kv-cache-memory-bytes"])
    assert kv == int((20 - 15.2 - 1.5) * GiB) // 4 // MiB * MiB
    assert int(got["--max-model-len"]) == kv // 57_344 // 128 * 128 < 32_768
    reasons = {c.name: c.reason for c in choices}
    assert "what a KV cache of" in reasons["--max-model-len"] and "a quarter of the 3.3 GiB" in reasons["--kv-cache-memory-bytes"]


def test_a_large_host_caps_the_cache():
    got = flags(choose_model_flags([], available=512 * GiB, environ={}, **QWEN7B))
    assert got == {"--kv-cache-memory-bytes": str(4 * GiB), "--max-model-len": "32768"}  # 4 x 1.75 GiB wanted, capped at 4 GiB


def test_no_room_at_all_still_starts_with_the_floor():
    got = flags(choose_model_flags([], available=1 * GiB, environ={}, **QWEN7B))
    assert got["--kv-cache-memory-bytes"] == str(64 * MiB)
    assert got["--max-model-len"] == str(64 * MiB // 57_344 // 128 * 128)


def test_unknown_files_fall_back_to_2048_tokens():
    got = flags(choose_model_flags([], weights=0, kv_per_token=0, context=None, available=8 * GiB, environ={}))
    assert got["--max-model-len"] == "2048"
    assert int(got["--kv-cache-memory-bytes"]) == (8 * GiB - int(1.5 * GiB)) // 4 // MiB * MiB


def test_the_operators_flags_win():
    assert choose_model_flags(["--max-model-len", "1024", "--kv-cache-memory-bytes", "128M"], available=8 * GiB,
                              environ={}, **TOOL) == []
    # a cache given: the context is still capped to what it holds
    got = flags(choose_model_flags(["--kv-cache-memory-bytes", "1M"], available=8 * GiB, environ={}, **TOOL))
    assert got == {"--max-model-len": "256"}  # 1 MiB / 3 KiB = 341 tokens, two blocks of 128
    got = flags(choose_model_flags([], available=8 * GiB, environ={"VLLM_CPU_KVCACHE_SPACE": "1"}, **QWEN7B))
    assert got == {"--max-model-len": str(GiB // 57_344 // 128 * 128)}
    got = flags(choose_model_flags(["--gpu-memory-utilization", "0.5"], available=8 * GiB, environ={}, **TOOL))
    assert got == {"--max-model-len": "2048"}  # vLLM sizes its cache from its RAM share: the context is not known to fit
    assert flags(choose_model_flags(["--max-model-len", "512"], available=8 * GiB, environ={}, **TOOL)).keys() == {"--kv-cache-memory-bytes"}


def test_vllm_threads_leave_a_quarter_of_the_cpus_to_the_front_end():
    assert flags(choose_host_env(2, {})) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert flags(choose_host_env(16, {})) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "4"}
    assert flags(choose_host_env(2.5, {})) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert choose_host_env(16, {"VLLM_CPU_OMP_THREADS_BIND": "0-11"}) == []
    assert choose_host_env(16, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}) == []


def test_with_cpu_flags_reads_the_model_from_disk():
    from conftest import ROOT
    from vllama_proxy.models.launch_spec import ModelConfig

    spec = cpu_serving.with_cpu_flags(ModelConfig(model=str(ROOT / "tests" / "assets" / "tool-model")), {}, available=8 * GiB)
    assert spec.vllm_args == ["--kv-cache-memory-bytes", str(64 * MiB), "--max-model-len", "4096"]
    assert spec.context_length == 4096


# --- which vLLM: the CPU build or a GPU one ------------------------------------------------------


def script(path, shebang: str, body: str) -> str:
    path.write_text(f"#!{shebang}\n{body}\n")
    path.chmod(0o755)
    return str(path)


def fake_python(tmp_path, version: str | None) -> str:
    """An interpreter that answers the metadata question with ``version`` (or fails: not installed)."""
    answer = f"echo {version}" if version else "exit 1"
    return script(tmp_path / "python", "/bin/sh", answer)


VLLM_SCRIPT = "import sys\nfrom vllm.entrypoints.cli.main import main\nsys.exit(main())"


def test_the_cpu_build_is_told_by_its_version(tmp_path):
    vllm = script(tmp_path / "vllm", fake_python(tmp_path, "0.32.0+cpu"), VLLM_SCRIPT)
    found = engine.detect(vllm, environ={})
    assert (found.device, found.version, found.on_cpu) == ("cpu", "0.32.0+cpu", True)


def test_a_gpu_build_and_a_missing_package(tmp_path):
    vllm = script(tmp_path / "vllm", fake_python(tmp_path, "0.26.0"), VLLM_SCRIPT)
    assert engine.detect(vllm, environ={}).device == "gpu"
    assert engine.detect(vllm, environ={"VLLM_TARGET_DEVICE": "cpu"}).device == "cpu"  # vLLM's own first rule
    (tmp_path / "python").unlink()
    fake_python(tmp_path, None)
    assert engine.detect(vllm, environ={}).device == "unknown"


def test_a_wrapper_or_stand_in_is_unknown_and_none_is_missing(tmp_path):
    from conftest import ROOT

    assert engine.detect(str(ROOT / "tests" / "bin" / "vllm"), environ={}).device == "unknown"
    wrapper = script(tmp_path / "vllm", "/bin/sh", "exec docker run vllm/vllm-openai \"$@\"")
    assert engine.detect(wrapper, environ={}).device == "unknown"
    assert engine.detect(str(tmp_path / "nothing"), environ={}).device == "missing"


def test_this_interpreter_is_asked_in_process(tmp_path, monkeypatch):
    vllm = script(tmp_path / "vllm", sys.executable, VLLM_SCRIPT)
    monkeypatch.setattr(engine.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no subprocess")))
    found = engine.detect(vllm, environ=dict(os.environ))
    assert found.device in ("cpu", "gpu", "unknown")  # whatever this venv holds, read without a subprocess


def test_the_cpu_builds_own_max_num_seqs_is_the_default():
    """vllm-cpu 0.32 runs 128 requests at once by default (per tensor x pipeline rank:
    ``EngineArgs.get_batch_defaults``), not a GPU's 1,024: the admission bound, the fair queue and
    ``vllama batch`` size themselves by it."""
    from vllama_proxy.api.request.admission import default_max_num_seqs, running_capacity
    from vllama_proxy.models.launch_spec import ModelConfig

    seqs = default_max_num_seqs(None, on_cpu=True)
    assert seqs == 128
    specs = [ModelConfig(model="/a", name="a"),
             ModelConfig(model="/b", name="b", vllm_args=["--tensor-parallel-size", "2"]),
             ModelConfig(model="/c", name="c", vllm_args=["--max-num-seqs", "8", "-tp", "2"]),
             ModelConfig(model="/d", name="d", vllm_args=["--performance-mode", "throughput"])]
    assert running_capacity(specs, seqs, per_rank=True) == 128 + 256 + 8 + 256


def test_served_on_the_cpu_build_vllama_tells_and_logs_128_running(vllama):
    """``vllama serve`` with the CPU build (the stand-in, told by vLLM's own ``VLLM_TARGET_DEVICE=cpu``
    rule) and no ``--max-num-seqs``: ``/api/version`` says 128 (vllama assumed 1,024 before), and
    the ``admission`` line says where the number came from."""
    import json

    from conftest import get_json

    v = vllama(env={"VLLM_TARGET_DEVICE": "cpu"})
    v.wait_state("ready")
    assert get_json(v.url + "/api/version")["max_running"] == 128
    line = next(json.loads(x) for x in v.log.read_text().splitlines() if '"admission"' in x)
    assert line["running"] == 128 and line["max_num_seqs_default"] == 128 and "vllm-cpu" in line["max_num_seqs_source"]
    assert v.stop() == 0
