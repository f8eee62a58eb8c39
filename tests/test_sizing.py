"""The front end's automatic size: CPUs seen (affinity, cgroup quota) -> vLLM's API servers and vllama's workers.

Unit tests of the rule and of the cgroup readers (on cgroup files made here), then the real
thing: ``vllama serve --model`` with the stand-in vllm, whose command line and worker
processes are read back with psutil.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import psutil
import pytest

from vllama_proxy.models.launch_spec import ModelConfig
from vllama_proxy.supervisor import sizing
from vllama_proxy.supervisor.placement import engine_core_pids, plan_placement
from vllama_proxy.supervisor.sizing import engine_gpus, engine_slots, plan, usable_cpus, with_api_servers


def one(*vllm_args: str, **kw) -> list[ModelConfig]:
    return [ModelConfig(model="/m", name="m", vllm_args=list(vllm_args), **kw)]


@pytest.mark.parametrize(
    ("cpus", "args", "api", "workers"),
    [
        (16, (), 8, 4),  # the lent H200 machine: 1 engine core, then half of 15 to vLLM, a quarter to vllama
        (32, ("--data-parallel-size", "2"), 15, 8),  # 2 engines: 30 left
        (8, (), 4, 2),
        (2, (), 1, 1),  # this CI machine: vLLM's own default, one worker
        (4, ("--data-parallel-size", "4"), 4, 1),  # never fewer API servers than vLLM's default (the DP size)
        (128, (), 8, 32),  # capped: 8 API servers per engine, 32 workers
        (16, ("--tensor-parallel-size", "4"), 6, 3),  # 4 GPU workers + 1 engine core kept
    ],
)
def test_rule(cpus, args, api, workers):
    p = plan(cpus, "test", one(*args), None)
    assert (p.api_servers["m"], p.workers) == (api, workers)
    assert p.api_servers_source["m"] == "auto" and p.workers_source == "auto"


@pytest.mark.parametrize(("cpus", "workers"), [(16, 8), (2, 1), (128, 32)])
def test_a_front_with_no_vllm_gives_its_workers_the_api_servers_half(cpus, workers):
    """A fleet's front (--upstream, --router) launches no vLLM: half its CPUs translate (1 to 32)."""
    p = plan(cpus, "test", [], None, vllm_here=False)
    assert (p.workers, p.api_servers) == (workers, {})


@pytest.mark.parametrize(("upstream", "workers"), [(None, 4), ("http://127.0.0.1:8000", 8)])
def test_a_server_with_no_model_configured_starts_vllm_on_demand_and_keeps_its_half_for_it(upstream, workers):
    """``vllama serve`` with no model configured launches vLLM for the first request that names a
    pulled model (on demand, with the API servers the rule gives it): its workers keep a quarter of
    16 CPUs, as with a model configured; only a front with no vLLM of its own (``--upstream``)
    gives them half."""
    from vllama_proxy.settings import Settings

    _, p = sizing.resolve(Settings(cpus=16, upstream=upstream), [])
    assert p.workers == workers


def test_explicit_flags_win():
    p = plan(16, "test", one("--api-server-count", "3"), 2)
    assert (p.api_servers["m"], p.api_servers_source["m"], p.workers, p.workers_source) == (3, "vllm_args", 2, "--workers")
    spec = one("--api-server-count=3")[0]
    assert with_api_servers(spec, plan(16, "t", [spec], None)).vllm_args == ["--api-server-count=3"]  # not added again


@pytest.mark.parametrize(
    ("cpus", "args", "upstream", "connects"),
    [
        (16, (), None, 32),  # the H200 machine: 8 API servers x 32 = 256, capped at 128, over 4 workers
        (2, (), None, 32),  # this machine: one API server, one worker
        (8, ("--api-server-count", "1"), None, 16),  # one API server, 2 workers
        (16, (), "http://127.0.0.1:8000", 16),  # a front: API servers not known, 128 over 8 workers
        (128, (), "http://127.0.0.1:8000", 4),  # 128 over 64 workers would be 2: at least 4 each
    ],
)
def test_connections_opened_at_once_follow_vllms_api_servers(cpus, args, upstream, connects):
    """Each worker opens a bounded number of connections to one vLLM at once (``upstream/pool.py``); a burst's
    other requests wait in vllama: 32 per API server, at most 128 over the workers, at least 4 per worker."""
    from vllama_proxy.settings import Settings

    _, p = sizing.resolve(Settings(cpus=cpus, upstream=upstream), one(*args) if upstream is None else [])
    assert p.connects == connects and p.connects_source.startswith("auto")
    assert p.as_dict()["connects_per_worker"] == connects
    _, p = sizing.resolve(Settings(cpus=cpus, upstream=upstream, connect_concurrency=7), [])
    assert (p.connects, p.connects_source) == (7, "--connect-concurrency")


@pytest.mark.parametrize("flag", [["--headless"], ["--data-parallel-rank", "0"], ["--data-parallel-external-lb"], ["--grpc"]])
def test_vllm_decides_where_it_must(flag):
    p = plan(16, "test", one(*flag), None)
    assert p.api_servers_source["m"] == "vllm"
    assert "--api-server-count" not in with_api_servers(one(*flag)[0], p).vllm_args


def test_runtime_lora_updating_keeps_one_api_server(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM refuses it with several
    assert plan(16, "test", one(), None).api_servers["m"] == 1


def test_several_models_share_the_cores():
    specs = [ModelConfig(model="/a", name="a"), ModelConfig(model="/b", name="b", vllm_args=["--api-server-count", "5"])]
    p = plan(32, "test", specs, None)
    assert p.api_servers == {"a": 8, "b": 5}  # (32 - 2) / 2 / 2 models, rounded; b as given
    assert p.workers == 8


def test_api_servers_added_only_when_not_vllms_default():
    spec = one()[0]
    assert with_api_servers(spec, plan(16, "t", [spec], None)).args()[-2:] == ["--api-server-count", "8"]
    assert with_api_servers(spec, plan(2, "t", [spec], None)).args() == []  # 1: vLLM's default, left out


def cgroup_v2(tmp_path: Path, quotas: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cg"
    for rel, quota in quotas.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(quota + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    return root, proc


def test_cgroup_v2_quota_smallest_up_the_tree(tmp_path):
    root, proc = cgroup_v2(tmp_path, {"kubepods/pod1/ctr": "max 100000", "kubepods/pod1": "250000 100000", "kubepods": "max 100000"})
    cpus, source = usable_cpus(root, proc)
    import os

    if len(os.sched_getaffinity(0)) > 2.5:
        assert cpus == 2.5 and "quota 2.5" in source
    else:  # this machine has fewer CPUs than the quota: affinity wins
        assert cpus == len(os.sched_getaffinity(0)) and source.startswith("CPU affinity")
    root, proc = cgroup_v2(tmp_path / "b", {"kubepods/pod1/ctr": "50000 100000"})
    assert usable_cpus(root, proc) == (1.0, f"cgroup CPU quota 0.5 (affinity {len(os.sched_getaffinity(0))})")  # at least 1


def test_smallest_quota_up_the_tree_whatever_this_machine_has(tmp_path):
    from vllama_proxy.supervisor.sizing import _cgroup_quota

    root, proc = cgroup_v2(tmp_path, {"kubepods/pod1/ctr": "max 100000", "kubepods/pod1": "250000 100000", "kubepods": "800000 100000"})
    assert _cgroup_quota(root, proc) == 2.5
    proc.write_text("garbage\n0::/kubepods/pod1/ctr\n")  # a malformed line is skipped
    assert _cgroup_quota(root, proc) == 2.5


def test_cgroup_v1_quota(tmp_path):
    root = tmp_path / "cg"
    d = root / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("100000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert usable_cpus(root, proc)[0] == 1.0
    (d / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    import os

    assert usable_cpus(root, proc)[0] == len(os.sched_getaffinity(0))


def test_no_cgroup_files_means_affinity(tmp_path):
    import os

    assert usable_cpus(tmp_path / "none", tmp_path / "none")[0] == len(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------- engine cores' CPUs


def no_smt(cpu: int) -> set[int]:
    return {cpu}


def test_sixteen_cpus_give_the_engine_core_the_last_one():
    p = plan_placement("auto", range(16), 16, {"m": [0]}, no_smt)
    assert p.engine_cpus == {"m": [[15]]} and p.other_cpus == list(range(15)) and p.source == "auto"


def test_an_engine_core_takes_a_whole_physical_core():
    smt = lambda c: {c % 8, c % 8 + 8}  # noqa: E731 - CPUs i and i+8 share a core
    p = plan_placement("auto", range(16), 16, {"m": [0]}, smt)
    assert p.engine_cpus == {"m": [[7, 15]]} and 7 not in p.other_cpus and len(p.other_cpus) == 14


def test_data_parallel_and_several_models_get_one_cpu_per_engine_core():
    p = plan_placement("auto", range(32), 32, {"a": [0, 1], "b": [0]}, no_smt)
    assert p.engine_cpus == {"a": [[31], [30]], "b": [[29]]} and p.other_cpus == list(range(29))


@pytest.mark.parametrize(
    ("mode", "affinity", "cpus", "pinned"),
    [
        ("auto", range(4), 4, False),  # 3 left for everything else: the kernel decides
        ("auto", range(5), 5, True),
        ("on", range(2), 2, True),  # forced: one CPU each
        ("on", range(1), 1, False),  # nothing would be left
        ("auto", range(64), 4, False),  # a cgroup quota of 4 CPUs on a 64-CPU host: shared CPUs
        ("auto", range(64), 32, False),  # a Kubernetes limit of 32 without a cpuset: still shared
        ("on", range(64), 32, True),  # forced
        ("off", range(16), 16, False),
    ],
)
def test_when_engine_cores_are_pinned(mode, affinity, cpus, pinned):
    p = plan_placement(mode, affinity, cpus, {"m": [0]}, no_smt)
    assert p.active is pinned
    assert p.source == mode if pinned else p.source.startswith("off")


def test_instances_with_their_own_gpus_pick_different_cores():
    # one vllama per GPU on an 8-GPU host, each seeing all 64 CPUs: slot = the GPU's host number
    picks = [plan_placement("auto", range(64), 64, {"m": [gpu]}, no_smt).engine_cpus["m"][0] for gpu in range(8)]
    assert picks == [[63 - g] for g in range(8)]
    smt = lambda c: {c % 32, c % 32 + 32}  # noqa: E731 - CPUs i and i+32 share a core
    picks = [plan_placement("auto", range(64), 64, {"m": [gpu]}, smt).engine_cpus["m"][0] for gpu in range(8)]
    assert picks == [[31 - g, 63 - g] for g in range(8)]  # whole cores, never a sibling of another's
    # a DP 2 instance on GPUs 2 and 3, and two models sharing GPU 0, within one process
    p = plan_placement("auto", range(16), 16, {"a": [2, 3], "b": [0], "c": [0]}, no_smt)
    assert p.engine_cpus == {"a": [[13], [12]], "b": [[15]], "c": [[14]]}
    # a slot beyond the cores wraps around
    assert plan_placement("on", range(4), 4, {"m": [5]}, no_smt).engine_cpus == {"m": [[2]]}


def test_engine_gpus_follow_the_config_and_cuda_visible_devices():
    tp2dp2 = ModelConfig(model="m", vllm_args=["-tp", "2", "--data-parallel-size", "2"])
    assert engine_gpus(tp2dp2, {}) == [0, 2]
    assert engine_gpus(tp2dp2.model_copy(update={"gpus": [4, 5, 6, 7]}), {}) == [4, 6]
    assert engine_gpus(ModelConfig(model="m"), {"CUDA_VISIBLE_DEVICES": "3"}) == [3]
    assert engine_gpus(ModelConfig(model="m"), {"CUDA_VISIBLE_DEVICES": "GPU-8a1b, 1"}) == ["GPU-8a1b"]
    # multi-node data parallel: only the local ranks' engine cores run here
    assert engine_gpus(ModelConfig(model="m", vllm_args=["-dp", "4", "--data-parallel-size-local", "2"]), {}) == [0, 1]


def test_engine_slots_are_host_gpu_numbers_else_ranks(monkeypatch):
    tp2dp2 = ModelConfig(model="m", vllm_args=["-tp", "2", "--data-parallel-size", "2"], gpus=[4, 5, 6, 7])
    asked = []
    monkeypatch.setattr(sizing, "host_numbers", lambda gpus: asked.append(list(gpus)) or [None, 3])
    assert engine_slots(tp2dp2) == [4, 3] and asked == [[4, 6]]  # rank 0's GPU not named by NVML: its index
    monkeypatch.setattr(sizing, "host_numbers", lambda gpus: [None] * len(gpus))  # no NVML
    assert engine_slots(tp2dp2) == [4, 6]
    by_uuid = ModelConfig(model="m", vllm_args=["--data-parallel-size", "2"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    assert engine_slots(by_uuid) == [0, 1]  # neither NVML nor an index: the rank


def test_only_the_first_model_on_a_gpu_set_gets_an_engine_cpu(monkeypatch):
    monkeypatch.setattr(sizing, "host_numbers", lambda gpus: [None] * len(gpus))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    specs = [ModelConfig(model="a", gpus=[0]), ModelConfig(model="b", gpus=[0]), ModelConfig(model="c", gpus=[1]),
             ModelConfig(model="d", gpus=[2], vllm_args=["--data-parallel-backend", "ray"]),
             ModelConfig(model="e", gpus=[3], vllm_args=["--headless"])]
    assert sizing.pinned_engines(specs) == {"a": [0], "c": [1]}  # b swaps with a; Ray and headless place their own


def test_engine_cores_found_by_title_in_rank_order():
    import subprocess

    def titled(title: str, script: str = "sleep 30; :") -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", f"exec -a '{title}' bash -c '{script}'"])

    procs = [titled("VLLM::EngineCore_DP10"), titled("MYCO::EngineCore_DP2"), titled("VLLM::APIServer_0"),
             titled("python3 -m EngineCore_helper"),
             titled("VLLM::EngineCore_DP0", "(sleep 30; :) & wait")]  # DP0, with a fork of itself that keeps the title
    try:
        time.sleep(0.3)
        found = engine_core_pids([p.pid for p in procs])
        assert found == [procs[4].pid, procs[1].pid, procs[0].pid]  # DP0, DP2, DP10: numeric, not string order
        # a fork that kept the title is not another engine core
        fork = psutil.Process(procs[4].pid).children()[0]
        assert fork.cmdline()[0] == "VLLM::EngineCore_DP0"
        assert engine_core_pids([procs[4].pid, fork.pid]) == [procs[4].pid]
    finally:
        for p in procs:
            for c in psutil.Process(p.pid).children(recursive=True):
                c.kill()
            p.kill()
            p.wait()


def test_no_vllm_launched_no_pinning():
    assert not plan_placement("auto", range(16), 16, {}, no_smt).active


# ----------------------------------------------------------------------------- the real thing


def worker_count(pid: int) -> int:
    return sum("spawn_main" in " ".join(p.cmdline()) for p in psutil.Process(pid).children())


def wait_workers(v, n: int) -> None:
    deadline = time.monotonic() + 20
    while worker_count(v.proc.pid) != n - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_count(v.proc.pid) == n - 1  # the main process is worker 0


def test_sixteen_cpus_give_eight_api_servers_and_four_workers(vllama):
    v = vllama(flags=["--cpus", "16"])
    body = v.wait_state("ready")
    argv = psutil.Process(v.server_pid()).cmdline()
    assert argv[argv.index("--api-server-count") + 1] == "8"
    wait_workers(v, 4)
    assert body["front_end"]["workers"] == 4 and body["front_end"]["cpus_source"] == "--cpus"
    assert body["front_end"]["vllm_api_servers"] == {"tiny": {"count": 8, "source": "auto"}}
    # vLLM makes its own Prometheus directory for its API servers: vllama's (4 workers) is not passed on
    env = psutil.Process(v.server_pid()).environ()
    assert "PROMETHEUS_MULTIPROC_DIR" not in env
    assert "front_end" in (v.log.read_text())


def test_explicit_workers_and_api_server_count_win(vllama):
    v = vllama(flags=["--cpus", "16", "--workers", "2"], vllm_args=["--api-server-count", "3"])
    body = v.wait_state("ready")
    argv = psutil.Process(v.server_pid()).cmdline()
    assert argv.count("--api-server-count") == 1 and argv[argv.index("--api-server-count") + 1] == "3"
    wait_workers(v, 2)
    assert body["front_end"]["workers_source"] == "--workers"
    assert httpx.post(v.url + "/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False}).status_code == 200


def affinity_of(pid: int) -> list[int]:
    """The CPUs of every thread of ``pid`` (they must agree)."""
    sets = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{pid}/task")}
    assert len(sets) == 1, sets
    return list(sets.pop())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_engine_core_gets_its_own_cpu_and_keeps_it_across_a_restart(vllama):
    cpus = sorted(os.sched_getaffinity(0))
    v = vllama(env={"FAKE_VLLM_GRANDCHILD": "1"}, flags=["--pin-engine-core", "on", "--workers", "2"])
    body = v.wait_state("ready")
    engine, rest = [cpus[-1]], cpus[:-1]
    assert body["front_end"]["engine_cpus"] == {"tiny": [engine]} and body["front_end"]["engine_cpus_source"] == "on"
    assert body["front_end"]["other_cpus"] == rest
    deadline = time.monotonic() + 10
    while affinity_of(v.grandchild_pid()) != engine and time.monotonic() < deadline:
        time.sleep(0.05)
    assert affinity_of(v.grandchild_pid()) == engine  # the EngineCore process, every thread
    wait_workers(v, 2)
    for pid in [v.proc.pid, v.server_pid(), *(p.pid for p in psutil.Process(v.proc.pid).children())]:
        assert affinity_of(pid) == rest, pid  # vllama, its worker, vLLM's API server
    first = v.grandchild_pid()
    os.kill(v.server_pid(), 9)  # vLLM dies: vllama restarts it, and pins the new engine core again
    v.wait_state("ready", timeout=30, restarts=1)
    deadline = time.monotonic() + 10
    while (v.grandchild_pid() == first or affinity_of(v.grandchild_pid()) != engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert v.grandchild_pid() != first and affinity_of(v.grandchild_pid()) == engine
    assert '"engine_core_pinned"' in v.log.read_text()


def test_auto_leaves_a_small_or_shared_machine_to_the_kernel(vllama):
    v = vllama(env={"FAKE_VLLM_GRANDCHILD": "1"}, flags=["--cpus", "2"])  # a CPU quota of 2, as CI's 2 CPUs
    body = v.wait_state("ready")
    source = body["front_end"]["engine_cpus_source"]
    assert body["front_end"]["engine_cpus"] == {} and source.startswith(("off (too few CPUs", "off (a CPU budget")), source
    assert affinity_of(v.grandchild_pid()) == sorted(os.sched_getaffinity(0))
    assert affinity_of(v.proc.pid) == sorted(os.sched_getaffinity(0))
