"""Fit before start (issue 22.4): the estimate from a model's files, the verdict and its advice,
the refusal through the pool (no vLLM launched), and a client's answer for a model that cannot fit.

Model directories are written here: a ``config.json`` and safetensors files whose headers (8-byte
little-endian length + JSON) declare the real shapes of Qwen2.5-7B; the tensor data is left out
(only the headers are read), except for the tiny model the stand-in vLLM serves.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import struct
import sys
import time
from pathlib import Path

import httpx
import pytest
from ollama import Client, ResponseError

from conftest import TESTS, free_port
from vllama_proxy.errors import ModelTooLarge
from vllama_proxy.models import fit
from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor import gpu
from vllama_proxy.supervisor.pool import Hold, ModelPool
from vllama_proxy.supervisor.states import State

GiB = 1 << 30
_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "F8_E4M3": 1}

# Qwen/Qwen2.5-7B-Instruct's config.json (the fields the estimate reads)
QWEN7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "vocab_size": 152064, "torch_dtype": "bfloat16", "sliding_window": 131072, "use_sliding_window": False,
    "max_window_layers": 28, "rope_scaling": None, "tie_word_embeddings": False,
}
QWEN7B_PARAMS = 7_615_616_512  # Qwen2.5-7B's parameter count (model card: 7.61B)
QWEN7B_KV_PER_TOKEN = 2 * 28 * 4 * 128 * 2  # K and V x layers x KV heads x head_dim x bf16 = 57,344


def qwen7b_tensors(dtype: str = "BF16") -> dict[str, tuple[str, list[int]]]:
    """Qwen2.5-7B's tensors and shapes (q/k/v with biases, untied output head)."""
    h, i, kv, v = 3584, 18944, 4 * 128, 152064
    t = {"model.embed_tokens.weight": (dtype, [v, h]), "lm_head.weight": (dtype, [v, h]), "model.norm.weight": (dtype, [h])}
    for n in range(28):
        p = f"model.layers.{n}."
        t |= {p + "self_attn.q_proj.weight": (dtype, [h, h]), p + "self_attn.q_proj.bias": (dtype, [h]),
              p + "self_attn.k_proj.weight": (dtype, [kv, h]), p + "self_attn.k_proj.bias": (dtype, [kv]),
              p + "self_attn.v_proj.weight": (dtype, [kv, h]), p + "self_attn.v_proj.bias": (dtype, [kv]),
              p + "self_attn.o_proj.weight": (dtype, [h, h]),
              p + "mlp.gate_proj.weight": (dtype, [i, h]), p + "mlp.up_proj.weight": (dtype, [i, h]),
              p + "mlp.down_proj.weight": (dtype, [h, i]),
              p + "input_layernorm.weight": (dtype, [h]), p + "post_attention_layernorm.weight": (dtype, [h])}
    return t


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], *, data: bool = False) -> int:
    """A safetensors file: 8-byte little-endian header length, the JSON header, then the data
    (written only when ``data``: a header is all the estimate reads). Returns the data's bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * _BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + (b"\0" * offset if data else b""))
    return offset


def write_model(path: Path, config: dict, tensors: dict[str, tuple[str, list[int]]], shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    if shards == 1:
        write_safetensors(path / "model.safetensors", tensors)
        return path
    weight_map = {}
    for k in range(shards):
        part = {n: tensors[n] for n in names[k::shards]}
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(path / fname, part)
        weight_map |= dict.fromkeys(part, fname)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("fit") / "qwen7b", QWEN7B, qwen7b_tensors(), shards=4)


# --- the estimate ------------------------------------------------------------------------------------

def test_qwen7b_weights_kv_and_context_from_its_files(qwen7b):
    shape = fit.read_shape(qwen7b)
    assert shape is not None and len(shape.files) == 4
    assert shape.float_elements == QWEN7B_PARAMS and shape.stored_bytes == 0 and not shape.quantized
    est = fit.estimate(shape)
    assert est.weights == 2 * QWEN7B_PARAMS == 15_231_233_024  # bf16, as on the model card (15.2 GB)
    assert est.kv_per_token == QWEN7B_KV_PER_TOKEN == 57_344
    assert est.context == 32768  # max_position_embeddings
    assert est.kv == 57_344 * 32768 == 1_879_048_192  # 1.75 GiB
    assert est.overhead == fit.OVERHEAD_BYTES
    assert est.needed == 15_231_233_024 + 1_879_048_192 + fit.OVERHEAD_BYTES
    assert est.notes == ()
    # a 4-bit AWQ/GPTQ checkpoint: the 2-D layer weights at 4 + 20/128 bits, embeddings and output head stay bf16
    layer_2d = 28 * (2 * 3584 * 3584 + 2 * 512 * 3584 + 3 * 18944 * 3584)
    assert shape.quantizable_elements == layer_2d == 6_525_288_448
    expected = (QWEN7B_PARAMS - layer_2d) * 2 + layer_2d * (4 + 20 / 128) / 8
    assert est.quantized_weights == math.ceil(expected)
    assert 5.5e9 < est.quantized_weights < 5.65e9  # Qwen2.5-7B-Instruct-AWQ's files: 5.58 GB
    assert "weights 14.2 GiB + KV cache for 32,768 tokens 1.8 GiB + overhead 0.9 GiB" in est.describe()


@pytest.mark.parametrize("args,context,kv_per_token", [
    (["--max-model-len", "8192"], 8192, 57_344),
    (["--max-model-len=8k"], 8000, 57_344),  # vLLM: k = 1000, K = 1024
    (["--max-model-len", "8K"], 8192, 57_344),
    (["--kv-cache-dtype", "fp8"], 32768, 57_344 // 2),
    (["--kv-cache-dtype", "fp8_e5m2", "--max-model-len", "1024"], 1024, 57_344 // 2),
    (["--dtype", "float32"], 32768, 57_344 * 2),
])
def test_context_and_kv_dtype_follow_the_vllm_arguments(qwen7b, args, context, kv_per_token):
    est = fit.estimate(fit.read_shape(qwen7b), args)
    assert (est.context, est.kv_per_token) == (context, kv_per_token)


def test_max_model_len_auto_leaves_the_context_out(qwen7b):
    est = fit.estimate(fit.read_shape(qwen7b), ["--max-model-len", "auto"])
    assert est.context == 0 and est.kv == 0 and "sizes the context to the memory" in est.notes[0]


def test_tensor_and_pipeline_parallel_split_weights_and_kv_heads(qwen7b):
    shape = fit.read_shape(qwen7b)
    tp2 = fit.estimate(shape, tensor_parallel=2)
    assert tp2.weights == 15_231_233_024 // 2 and tp2.kv_per_token == 57_344 // 2 and tp2.split == 2
    tp8 = fit.estimate(shape, tensor_parallel=8)  # 4 KV heads over 8 GPUs: vLLM replicates, one head each
    assert tp8.kv_per_token == 2 * 28 * 1 * 128 * 2
    pp2 = fit.estimate(shape, pipeline_parallel=2)
    assert pp2.kv_per_token == 57_344 // 2 and pp2.weights == 15_231_233_024 // 2


def test_fp32_checkpoint_counts_as_vllm_loads_it_and_a_quantized_one_as_stored(tmp_path):
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 2048, "torch_dtype": "float32"}
    d = write_model(tmp_path / "fp32", small, {"embed.weight": ("F32", [1000, 64]), "layers.0.w": ("F32", [64, 64])})
    est = fit.estimate(fit.read_shape(d))
    assert est.weights == (1000 * 64 + 64 * 64) * 2  # vLLM's dtype "auto" runs an fp32 config in 16 bits
    assert est.kv_per_token == 2 * 2 * 2 * 16 * 2
    # AWQ: packed int32 weights and fp16 scales; no "quantized tag" advice for it
    awq = write_model(tmp_path / "awq", {**small, "torch_dtype": "float16", "quantization_config": {"quant_method": "awq", "bits": 4}},
                      {"embed.weight": ("F16", [1000, 64]), "layers.0.qweight": ("I32", [64, 8]), "layers.0.scales": ("F16", [1, 64])})
    shape = fit.read_shape(awq)
    assert shape.quantized and shape.stored_bytes == 64 * 8 * 4
    est = fit.estimate(shape)
    assert est.weights == (1000 * 64 + 64) * 2 + 64 * 8 * 4 and est.quantized_weights is None


def test_weight_files_follow_the_index_and_skip_mistral_consolidated_copies(tmp_path, qwen7b):
    d = tmp_path / "mistral"
    write_model(d, {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}, {"w": ("BF16", [64, 64])})
    write_safetensors(d / "consolidated.safetensors", {"w": ("BF16", [64, 64])})
    assert [f.name for f in fit.weight_files(d)] == ["model.safetensors"]
    assert fit.read_shape(d).float_elements == 64 * 64
    assert fit.read_shape(tmp_path / "absent") is None
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text("{}")
    assert fit.read_shape(tmp_path / "no-weights") is None


def test_mla_sliding_window_and_hybrid_layers_are_counted_as_vllm_holds_them(tmp_path):
    tensors = {"w": ("BF16", [64, 64])}
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "max_position_embeddings": 163840}  # DeepSeek-V3
    est = fit.estimate(fit.read_shape(write_model(tmp_path / "mla", mla, tensors)), tensor_parallel=8)
    assert est.kv_per_token == 61 * (512 + 64) * 2 and "MLA" in est.notes[0]  # not split over TP
    gemma = {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2560,
             "sliding_window": 1024, "max_position_embeddings": 131072,
             "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    est = fit.estimate(fit.read_shape(write_model(tmp_path / "gemma", gemma, tensors)), ["--max-model-len", "8192"])
    assert est.kv == 2 * 4 * 256 * 2 * (1 * 8192 + 5 * 1024)  # full layers the whole context, sliding ones their window
    hybrid = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
              "max_position_embeddings": 4096, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    est = fit.estimate(fit.read_shape(write_model(tmp_path / "hybrid", hybrid, tensors)))
    assert est.kv_per_token == 2 * 1 * 2 * 64 * 2 and "hybrid" in est.notes[0]


def test_context_from_the_config_as_vllm_derives_it():
    assert fit.config_context({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == 131072
    assert fit.config_context({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                                  "original_max_position_embeddings": 32768}}) == 131072
    assert fit.config_context({"n_positions": 2048, "max_position_embeddings": 4096}) == 2048
    assert fit.config_context({}) is None
    assert fit.parse_tokens("32k") == 32000 and fit.parse_tokens("32K") == 32768 and fit.parse_tokens("-1") is None


# --- the verdict and its advice -----------------------------------------------------------------------

def test_a_share_too_small_for_weights_and_context_is_refused_with_what_would_fit(qwen7b):
    est = fit.estimate(fit.read_shape(qwen7b))  # needs 15,231,233,024 + 1,879,048,192 + overhead = 16.8 GiB
    gpu0 = fit.GpuRoom(0, total=80 * GiB, free=80 * GiB, context=int(0.8 * GiB))
    report = fit.check("qwen2.5:7b", est, 0.2, [gpu0])  # 0.2 x 80 GiB = 16 GiB
    assert not report.fits
    # the longest context that fits in 16 GiB beside weights and overhead, a multiple of 1024:
    # (17,179,869,184 - 15,231,233,024 - overhead) // 57,344 = 17,129 tokens -> 16,384
    assert (16 * GiB - 15_231_233_024 - fit.OVERHEAD_BYTES) // 57_344 == 17_129
    assert report.max_context == 16384
    assert report.utilization_range == (0.22, 0.99)  # 16.84 GiB / 80 GiB = 0.2105 -> 0.22; (80 - 0.8) / 80
    assert report.quantized_fits and report.unload == ()
    msg = report.message()
    assert msg.startswith("model 'qwen2.5:7b' requires more GPU memory (16.8 GiB) than is available (16.0 GiB): ")
    assert "weights 14.2 GiB + KV cache for 32,768 tokens 1.8 GiB + overhead 0.9 GiB" in msg
    assert "gpu_memory_utilization 0.2 × 80.0 GiB gives it 16.0 GiB of GPU 0 (80.0 GiB free)" in msg
    assert msg.endswith("it would fit with gpu_memory_utilization between 0.22 and 0.99, or with max_model_len ≤ 16384, "
                        "or as a 4-bit quantized tag (AWQ/GPTQ: weights ~5.2 GiB)")
    # the same model with room to spare fits
    assert fit.check("qwen2.5:7b", est, 0.9, [gpu0]).fits


def test_too_little_free_memory_names_the_pinned_model_to_unload(qwen7b):
    est = fit.estimate(fit.read_shape(qwen7b), ["--max-model-len", "8192"])  # 14.2 + 0.4 + 0.9 GiB
    # 24 GiB GPU: 'pinned' holds 10 GiB, something outside vllama 2 GiB; an idle evictable model would free 3 GiB
    gpu0 = fit.GpuRoom(0, total=24 * GiB, free=9 * GiB, reclaimable=3 * GiB, context=GiB // 4)
    report = fit.check("big", est, 0.7, [gpu0], [("pinned", {0: 10 * GiB})])
    assert not report.fits and report.unload == (("pinned", 10 * GiB),)
    msg = report.message()
    # vLLM would find 12 - 0.25 GiB free, less than 0.7 x 24 GiB = 16.8 GiB: it takes the share at start
    assert msg.startswith("model 'big' requires more GPU memory (16.8 GiB) than is available (11.8 GiB): ")
    assert "vLLM takes gpu_memory_utilization 0.7 × 24.0 GiB = 16.8 GiB of GPU 0 at start, which has 9.0 GiB free, " \
           "12.0 GiB once idle models are unloaded" in msg
    assert "as a 4-bit quantized tag" in msg and "after unloading 'pinned' (10.0 GiB)" in msg
    assert report.max_context == 0  # 11.75 GiB cannot hold 14.2 GiB of weights at any context
    # free room for the weights but not the share: a smaller share is the fix
    roomy = fit.GpuRoom(0, total=24 * GiB, free=17 * GiB, context=GiB // 4)
    report = fit.check("big", est, 0.9, [roomy])
    assert not report.fits and report.utilization_range == (0.65, 0.69)
    assert "it would fit with gpu_memory_utilization between 0.65 and 0.69" in report.message()


def test_a_model_bigger_than_any_share_suggests_more_gpus(qwen7b):
    est = fit.estimate(fit.read_shape(qwen7b), ["--max-model-len", "4096"])
    report = fit.check("big", est, 0.9, [fit.GpuRoom(0, total=12 * GiB, free=12 * GiB, context=GiB // 8)])
    assert not report.fits and report.max_context == 0 and report.tensor_parallel == 2
    assert "on 2 GPUs (tensor_parallel_size 2)" in report.message()


# --- the refusal through the pool: no vLLM is launched ------------------------------------------------

@pytest.fixture
def knobs(monkeypatch):
    monkeypatch.setenv("PATH", f"{TESTS / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_VLLM_PYTHON", sys.executable)
    return monkeypatch


def tiny_model(path: Path) -> Path:
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "model_type": "qwen2"}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    write_safetensors(path / "model.safetensors", {"embed.weight": ("BF16", [1000, 64])}, data=True)
    return path


def fake_gpus(monkeypatch, **gpus: tuple[float, float]) -> list[tuple]:
    """``gpu.memory`` answering (free, total) GiB per GPU ``g0=(free, total)``; returns the calls."""
    calls: list[tuple] = []

    def memory(indices):
        calls.append(tuple(indices))
        return {int(k[1:]): (int(f * GiB), int(t * GiB)) for k, (f, t) in gpus.items() if int(k[1:]) in indices}

    monkeypatch.setattr(gpu, "memory", memory)
    return calls


def launches(monkeypatch) -> list[str]:
    from vllama_proxy.supervisor import lifecycle

    launched: list[str] = []
    original = lifecycle.VllmProcess.launch

    async def launch(argv, **kw):
        launched.append(kw.get("model"))
        return await original(argv, **kw)

    monkeypatch.setattr(lifecycle.VllmProcess, "launch", staticmethod(launch))
    return launched


def pool_settings(tmp_path, **kw) -> Settings:
    base = dict(workers=1, gpu_check=True, startup_poll_interval=0.1, health_interval=0.2, stop_grace=2,
                load_timeout=10, gpu_release_timeout=1, state_dir=tmp_path / "state")
    return Settings(**{**base, **kw})


async def test_a_model_that_cannot_fit_is_not_launched_and_requests_get_the_numbers(tmp_path, knobs, qwen7b):
    calls = fake_gpus(knobs, g0=(23.5, 24))
    launched = launches(knobs)
    specs = [ModelConfig(model=str(tiny_model(tmp_path / "tiny")), name="tiny", gpu_memory_utilization=0.3),
             ModelConfig(model=str(qwen7b), name="qwen7b", gpu_memory_utilization=0.5)]  # 12 GiB: needs 16.8
    pool = ModelPool(pool_settings(tmp_path), specs, [free_port() for _ in specs])
    tiny, big = pool.supervisors
    await pool.start()
    try:
        await tiny.board.wait_ready(20)  # a model that fits starts as before
        deadline = time.monotonic() + 10
        while big.state is not State.UNLOADED and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert big.state is State.UNLOADED and big.child is None and big not in pool.holds
        assert "requires more GPU memory (16.8 GiB) than is available (12.0 GiB)" in big.last_error
        # 0.71 x 24 GiB holds it; 0.96 or 0.99 the room (23.5 GiB free less its context; all 24 with tiny evictable, if admitted first)
        assert re.search(r"it would fit with gpu_memory_utilization between 0\.71 and 0\.9[69], or as a 4-bit", big.last_error)
        assert big.board.status()["last_error"] == big.last_error
        # a request is answered at once, with the same message (Ollama's error; 507)
        t0 = time.monotonic()
        with pytest.raises(ModelTooLarge) as e:
            await big.board.wait_ready(timeout=10)
        assert time.monotonic() - t0 < 2 and e.value.status == 507
        assert e.value.message == big.last_error and "weights 14.2 GiB + KV cache for 32,768 tokens 1.8 GiB" in e.value.message
        assert launched == ["tiny"]  # the stand-in vLLM never ran for the model that does not fit
        assert (0,) in calls and tiny.state is State.READY
    finally:
        await pool.stop()


async def test_a_model_refused_for_memory_another_process_holds_starts_once_it_is_freed(tmp_path, knobs, qwen7b):
    fake_gpus(knobs, g0=(10, 24))  # something outside vllama holds 14 GiB
    launched = launches(knobs)
    knobs.setenv("FAKE_VLLM_START_DELAY", "0")
    specs = [ModelConfig(model=str(qwen7b), name="qwen7b", gpu_memory_utilization=0.8, preload=False)]  # 19.2 GiB: enough
    pool = ModelPool(pool_settings(tmp_path), specs, [free_port()])
    (big,) = pool.supervisors
    await pool.start()
    try:
        with pytest.raises(ModelTooLarge) as e:
            await big.board.wait_ready(timeout=10)
        assert e.value.message.startswith("model 'qwen7b' requires more GPU memory (19.2 GiB) than is available (9.8 GiB): ")
        assert "vLLM takes gpu_memory_utilization 0.8 × 24.0 GiB = 19.2 GiB of GPU 0 at start, which has 10.0 GiB free" in e.value.message
        assert launched == [] and big.state is State.UNLOADED
        fake_gpus(knobs, g0=(23.5, 24))  # freed: the next request checks again and starts it
        await big.board.wait_ready(timeout=20)
        assert launched == ["qwen7b"] and big.state is State.READY
    finally:
        await pool.stop()


async def test_the_check_counts_what_evicting_idle_models_frees_and_skips_without_nvml(tmp_path, knobs, qwen7b):
    specs = [ModelConfig(model="/idle", name="idle", gpu_memory_utilization=0.5),
             ModelConfig(model="/pinned", name="pinned", gpu_memory_utilization=0.5, pin=True),
             ModelConfig(model=str(qwen7b), name="qwen7b", gpu_memory_utilization=0.45, max_model_len=8192)]
    pool = ModelPool(pool_settings(tmp_path), specs, [free_port() for _ in specs])
    idle, pinned, big = pool.supervisors
    fake_gpus(knobs, g0=(30, 80))  # idle holds 40.8 GiB (0.51 of 80), another process 9.2: evicting idle makes room
    pool.holds[idle], idle.state = Hold.SHARE, State.READY
    report = await pool.fit_report(big)
    assert report.fits and report.gpus[0].reclaimable == int(0.51 * 80 * GiB)
    del pool.holds[idle]
    pool.holds[pinned], pinned.state = Hold.SHARE, State.READY  # a pinned one is never evicted
    report = await pool.fit_report(big)
    assert not report.fits and report.unload == (("pinned", int(0.51 * 80 * GiB)),)
    assert "after unloading 'pinned' (40.8 GiB)" in report.message()
    # no NVML (gpu.memory None), --no-gpu-check, or no local files: no estimate, no refusal
    knobs.setattr(gpu, "memory", lambda indices: None)
    assert await pool.fit_report(big) is None
    fake_gpus(knobs, g0=(1, 80))
    assert await ModelPool(pool_settings(tmp_path, gpu_check=False), specs, [1, 2, 3]).fit_report(big) is None
    assert await pool.fit_report(idle) is None  # /idle: no files here (a hub id vLLM downloads at start)


async def test_the_check_reads_the_gpu_cuda_visible_devices_gives_not_nvmls_first(tmp_path, knobs, qwen7b):
    """One node per GPU on a host (``CUDA_VISIBLE_DEVICES=1`` each): NVML numbers the host's GPUs and
    ignores that variable, so the node's "GPU 0" is NVML's GPU 1. Issue 43's four-GPU run: a node
    restarted on GPU 3 read GPU 0, full with another node's vLLM, and refused to start."""
    calls = fake_gpus(knobs, g0=(5, 80), g1=(79, 80))  # GPU 0: a neighbour's vLLM; GPU 1: this node's, free
    knobs.setenv("CUDA_VISIBLE_DEVICES", "1")
    specs = [ModelConfig(model=str(qwen7b), name="qwen7b", gpu_memory_utilization=0.85)]
    (big,) = (pool := ModelPool(pool_settings(tmp_path), specs, [free_port()])).supervisors
    report = await pool.fit_report(big)
    assert calls == [(1,)] and report.fits and report.gpus[0].free == 79 * GiB


async def test_a_model_with_gpus_and_one_on_cuda_visible_devices_share_the_gpu_they_both_name(tmp_path, knobs, qwen7b):
    """``CUDA_VISIBLE_DEVICES=1``: a model without ``gpus`` runs on host GPU 1 (the variable's first
    entry), and so does one with ``gpus = [1]`` (host indices: vllama gives its vLLM that variable).
    They are neighbours on GPU 1: the pool counts the idle one's share and evicts it to make room,
    instead of calling them apart by their positions (0 and 1) and refusing the second model."""
    knobs.setenv("CUDA_VISIBLE_DEVICES", "1")
    specs = [ModelConfig(model="/idle", name="idle", gpu_memory_utilization=0.6),
             ModelConfig(model=str(qwen7b), name="qwen7b", gpu_memory_utilization=0.45, max_model_len=8192, gpus=[1])]
    pool = ModelPool(pool_settings(tmp_path), specs, [free_port() for _ in specs])
    idle, big = pool.supervisors
    fake_gpus(knobs, g0=(80, 80), g1=(30, 80))  # GPU 1: idle's 48.8 GiB and 1.2 of another process
    pool.holds[idle], idle.state = Hold.SHARE, State.READY
    assert not pool.fits(big) and pool.victim(big) is idle  # 0.6 + 0.45 of one GPU: the idle one goes
    report = await pool.fit_report(big)
    assert report.fits and report.gpus[0].reclaimable == int(0.61 * 80 * GiB)


# --- end to end: `vllama serve` with a GPU of chosen memory (tests/fake_nvml), the ollama client ------

def test_serve_refuses_a_model_too_big_and_serves_the_one_that_fits(vllama, tmp_path, qwen7b):
    tiny = tiny_model(tmp_path / "tiny-model")
    cfg = (f'[[models]]\nmodel = "{tiny}"\nname = "tiny"\ngpu_memory_utilization = 0.3\n\n'
           f'[[models]]\nmodel = "{qwen7b}"\nname = "qwen2.5:7b"\ngpu_memory_utilization = 0.5\npreload = false\n')
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "fake_nvml"), os.environ.get("PYTHONPATH", "")]),
           "FAKE_NVML_GPUS": "24:23.5"}
    v = vllama(config=cfg, env=env, flags=["--gpu-check", "--gpu-release-timeout", "1"])
    deadline = time.monotonic() + 20
    while httpx.get(v.url + "/readyz").json()["models"][0]["state"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.05)
    client = Client(host=v.url)
    assert client.generate(model="tiny", prompt="hi", stream=False).response.startswith("tok0")
    t0 = time.monotonic()
    with pytest.raises(ResponseError) as e:
        client.generate(model="qwen2.5:7b", prompt="hi", stream=False)
    assert time.monotonic() - t0 < 5 and e.value.status_code == 507
    assert e.value.error.startswith("model 'qwen2.5:7b' requires more GPU memory (16.8 GiB) than is available (12.0 GiB)")
    assert "it would fit with gpu_memory_utilization between 0.71 and 0.99" in e.value.error
    with pytest.raises(ResponseError) as e:  # streaming asks the same way: the error before the stream begins
        list(client.chat(model="qwen2.5:7b", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert e.value.status_code == 507
    models = {m["model"]: m for m in httpx.get(v.url + "/readyz").json()["models"]}
    assert models["qwen2.5:7b"]["state"] == "unloaded" and "requires more GPU memory" in models["qwen2.5:7b"]["last_error"]
    lines = [json.loads(line) for line in v.log.read_text().splitlines() if line.startswith("{")]
    launched = [line["argv"][line["argv"].index("--served-model-name") + 1] for line in lines if line.get("event") == "launched"]
    assert launched == ["tiny"]  # no vLLM was started for the model that cannot fit
    estimates = [line for line in lines if line.get("event") == "fit_estimate"]
    assert {(x["model"], x["fits"]) for x in estimates} == {("tiny", True), ("qwen2.5:7b", False)}
    assert v.stop() == 0


@pytest.mark.parametrize("visible", ["1", "GPU-fake-1"])
def test_a_node_on_the_gpu_cuda_visible_devices_gives_reads_that_gpu_for_its_defaults_and_warnings(vllama, tmp_path, visible):
    """A fleet's node on a shared host (``CUDA_VISIBLE_DEVICES=1``, or its UUID): NVML numbers the
    host's GPUs and ignores that variable. vLLM's defaults that depend on the GPU come from GPU 1 (80 GiB:
    ``--max-num-seqs`` 1024, the running capacity vllama bounds and shares), not from NVML's GPU 0
    (40 GiB: 256), and GPU 0's memory, held by the neighbour's vLLM, is no warning of this node's."""
    tiny = tiny_model(tmp_path / "tiny-model")
    cfg = f'[[models]]\nmodel = "{tiny}"\nname = "tiny"\ngpu_memory_utilization = 0.3\n'
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "fake_nvml"), os.environ.get("PYTHONPATH", "")]),
           "FAKE_NVML_GPUS": "40:1,80:79", "CUDA_VISIBLE_DEVICES": visible}
    v = vllama(config=cfg, env=env, flags=["--gpu-check", "--gpu-release-timeout", "1"])
    v.wait_state("ready")
    lines = [json.loads(line) for line in v.log.read_text().splitlines() if line.startswith("{")]
    (admission,) = [line for line in lines if line.get("event") == "admission"]
    assert admission["running"] == 1024
    assert [line["detail"] for line in lines if line.get("event") == "gpu_memory_in_use"] == []
    assert v.stop() == 0
