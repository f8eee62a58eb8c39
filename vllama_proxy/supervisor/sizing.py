"""How many processes the front end gets: vLLM's API servers and vllama's own workers.

vLLM streams through its API-server process, so one caps what the GPU can stream; vLLM's
``--api-server-count N`` and vllama's ``--workers N`` run N processes on one port, but both cost cores
the engine core and the clients need. The split is read from the CPUs this process may really use
(affinity and cgroup quota): one core per GPU process for the engine; of the rest, half to vLLM's API
servers (at least the data-parallel size, at most 8 per engine), a quarter to vllama's workers (1 to
32), the last quarter free; a front with no vLLM of its own gives its workers half. Also chosen here:
how many connections each worker opens to one vLLM server at once (:func:`connects`, 32 per API
server, at most 128 over all workers, at least 4 per worker). Explicit flags always win; every choice
is logged and shown in ``/readyz``. The engine cores' CPUs: ``placement.py``. Why: ``docs/decisions.md``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllama_proxy.models.launch_spec import ModelConfig, has_flag, vllm_arg
from vllama_proxy.settings import Settings
from .gpu import host_numbers
from .placement import Placement, plan_placement

#: Most vLLM API servers per engine (data-parallel rank; docs/decisions.md).
MAX_API_SERVERS_PER_ENGINE = 8
#: Most vllama workers chosen automatically.
MAX_AUTO_WORKERS = 32
#: Connections vllama's workers together open at once to one vLLM server, per API server of it ...
CONNECTS_PER_API_SERVER = 32
#: ... at most (vllm-router 0.1.17 listens with a backlog of 128: the smallest queue met in front of vLLM) ...
MAX_CONNECTS = 128
#: ... and at least this many per worker.
MIN_CONNECTS_PER_WORKER = 4
#: vLLM flags under which it decides its API servers itself (headless, external or hybrid
#: load balancing, one server per rank, gRPC): vllama leaves ``--api-server-count`` alone.
_VLLM_DECIDES = (
    "--api-server-count", "-asc", "--headless", "--data-parallel-external-lb", "--data-parallel-rank", "-dpn",
    "--data-parallel-hybrid-lb", "--data-parallel-start-rank", "-dpr", "--data-parallel-multi-port-external-lb",
    "--grpc",
)
#: vLLM flags under which its engine cores are not this vLLM's local children to place.
_VLLM_PLACES_ENGINES = ("--headless", "--data-parallel-external-lb", "--data-parallel-rank", "-dpn",
                        "--data-parallel-hybrid-lb", "--data-parallel-start-rank", "-dpr")


def _cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """CPUs allowed by the cgroup quota of this process and its ancestors (smallest wins), or None.

    cgroup v2: ``cpu.max`` = ``"QUOTA PERIOD"`` or ``"max PERIOD"``; v1: ``cpu.cfs_quota_us``
    (-1: none) / ``cpu.cfs_period_us`` in the ``cpu`` controller's hierarchy.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue  # not a hierarchy line
        _, controllers, path = parts
        if controllers == "":  # v2 unified hierarchy
            base, files = root, ("cpu.max",)
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        d = base / path.lstrip("/")
        while True:
            q = _read_quota(d, files)
            if q is not None:
                found.append(q)
            if d == base or not str(d).startswith(str(base)):
                break
            d = d.parent
    return min(found) if found else None


def _read_quota(d: Path, files: tuple[str, ...]) -> float | None:
    try:
        if len(files) == 1:
            quota, period = (d / files[0]).read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((d / files[0]).read_text())
        period = int((d / files[1]).read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[float, str]:
    """``(CPUs, how they were found)``: the CPU affinity's size, lowered to the cgroup CPU quota.

    A quota of 2.5 CPUs counts as 2.5 (the callers round). Never less than 1.
    """
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 1
    quota = _cgroup_quota(root, proc_cgroup)
    if quota is not None and quota < affinity:
        return max(quota, 1.0), f"cgroup CPU quota {quota:g} (affinity {affinity})"
    return float(affinity), f"CPU affinity {affinity}"


def engine_cores(spec: ModelConfig) -> int:
    """Cores vLLM's engine keeps busy for one model: one per GPU process (tensor x pipeline x data
    parallel), plus one engine-core process per data-parallel rank when its workers are separate
    processes (tensor or pipeline parallel > 1)."""
    gpus = spec.gpu_count_needed()
    dp = _dp(spec)
    return gpus + (dp if gpus > dp else 0)


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[int | str] | None:
    """The GPUs this process (and a vLLM it starts without ``gpus``) may use, as NVML knows them:
    the inherited ``CUDA_VISIBLE_DEVICES``'s entries (indices, nvidia-smi order, or UUIDs); ``None``
    when it is not set (every GPU NVML sees). NVML itself numbers every GPU of the host and ignores
    the variable."""
    if not environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return None
    return [int(e) if e.strip().isdigit() else e.strip() for e in environ["CUDA_VISIBLE_DEVICES"].split(",")]


def model_gpus(spec: ModelConfig, environ: Mapping[str, str] = os.environ) -> list[int | str]:
    """The GPUs ``spec``'s vLLM drives, as NVML knows them: indices (nvidia-smi order) or UUIDs.
    ``gpus`` when set; else the first entries of the inherited ``CUDA_VISIBLE_DEVICES``; else the
    first GPUs (``ModelConfig.gpu_ids``)."""
    visible = visible_gpus(environ) if spec.gpus is None else None
    if visible is not None:
        return visible[:spec.gpu_count_needed()]
    return list(spec.gpu_ids)


def served_gpus(specs: list[ModelConfig], environ: Mapping[str, str] = os.environ) -> list[int | str] | None:
    """Every GPU the models ``specs`` drive (:func:`model_gpus`, each once, in order); with none
    configured, the visible ones (:func:`visible_gpus`; ``None``: every GPU NVML sees)."""
    gpus = list(dict.fromkeys(g for s in specs for g in model_gpus(s, environ)))
    return gpus or visible_gpus(environ)


def engine_gpus(spec: ModelConfig, environ: Mapping[str, str] = os.environ) -> list[int | str]:
    """The first GPU of each data-parallel rank that runs here (``--data-parallel-size-local``
    of them when given) of ``spec``'s vLLM (:func:`model_gpus`)."""
    per_rank = max(spec.gpu_count_needed() // _dp(spec), 1)
    local = int(vllm_arg(spec.args(), "--data-parallel-size-local", "-dpl") or _dp(spec))
    visible = model_gpus(spec, environ)
    return [visible[r * per_rank] for r in range(local) if r * per_rank < len(visible)]


def engine_slots(spec: ModelConfig) -> list[int]:
    """One slot per engine core for :func:`~vllama_proxy.supervisor.placement.plan_placement`:
    the host-wide number of its GPU (``gpu.host_numbers``), else the GPU's index, else its rank."""
    gpus = engine_gpus(spec)
    numbers = host_numbers(gpus) if gpus else []
    slots = [n if n is not None else g if isinstance(g, int) else r for r, (g, n) in enumerate(zip(gpus, numbers))]
    return slots or list(range(_dp(spec)))


def pinned_engines(specs: list[ModelConfig]) -> dict[str, list[int]]:
    """Served name -> engine slots, for the models whose engine cores get CPUs of their own: the
    first model (config order) on each set of GPUs, where vLLM decides its own data-parallel
    processes (``--headless``, external load balancing, Ray) never. Later models on the same GPUs
    (swapped by keep_alive, rarely busy together) run their engine cores on the shared CPUs
    rather than reserve one CPU per configured model."""
    out: dict[str, list[int]] = {}
    seen: set[tuple[int | str, ...]] = set()
    for s in specs:
        key = tuple(model_gpus(s))
        if key in seen or any(has_flag(s.args(), f) for f in _VLLM_PLACES_ENGINES) \
                or vllm_arg(s.args(), "--data-parallel-backend", "-dpb") == "ray":
            continue
        seen.add(key)
        out[s.served_name] = engine_slots(s)
    return out


def _dp(spec: ModelConfig) -> int:
    return int(vllm_arg(spec.args(), "--data-parallel-size", "-dp") or 1)


@dataclass(frozen=True)
class Plan:
    """The front end's size, as chosen (logged at start, shown in ``/readyz`` as ``front_end``).

    Attributes:
        cpus: CPUs this process may use, and ``cpus_source`` how that was found.
        workers: vllama proxy processes; ``workers_source`` ``"auto"`` or ``"--workers"``.
        api_servers: served name -> vLLM API servers, and for each how it was decided
            (``"auto"``, ``"vllm_args"``: given after ``--``, ``"vllm"``: vLLM's own default).
        connects: connections each worker opens at once to one vLLM server (:func:`connects`);
            ``connects_source``: ``"auto: ..."`` (the rule's inputs) or ``"--connect-concurrency"``.
    """

    cpus: float
    cpus_source: str
    workers: int
    workers_source: str
    api_servers: dict[str, int] = field(default_factory=dict)
    api_servers_source: dict[str, str] = field(default_factory=dict)
    placement: Placement = field(default_factory=Placement)
    #: connections each worker opens at once to one vLLM server (:func:`connects`), and how it was decided
    connects: int = MAX_CONNECTS
    connects_source: str = "auto"

    def as_dict(self) -> dict[str, object]:
        return {
            "cpus": self.cpus,
            "cpus_source": self.cpus_source,
            "workers": self.workers,
            "workers_source": self.workers_source,
            "vllm_api_servers": {n: {"count": c, "source": self.api_servers_source[n]} for n, c in self.api_servers.items()},
            "engine_cpus": self.placement.engine_cpus,
            "other_cpus": self.placement.other_cpus,
            "engine_cpus_source": self.placement.source,
            "connects_per_worker": self.connects,
            "connects_source": self.connects_source,
        }


def plan(cpus: float, cpus_source: str, specs: list[ModelConfig], workers: int | None, *, vllm_here: bool = True,
         connect_concurrency: int | None = None) -> Plan:
    """Choose vllama's workers and each model's vLLM API servers for ``cpus`` usable CPUs.

    Args:
        cpus: usable CPUs (:func:`usable_cpus`, or ``--cpus``).
        cpus_source: how ``cpus`` was found, for the log and ``/readyz``.
        specs: the models vllama launches at start (empty with ``--upstream``, and with none
            configured: those start on demand).
        workers: ``--workers`` if given (it wins), else ``None`` for the automatic choice.
        vllm_here: whether this server runs vLLM at all (``False`` with ``--upstream``/``--router``:
            its workers get the half kept for vLLM's API servers). Not ``bool(specs)``: a server with
            no model configured launches vLLM on demand, with the API servers this rule gives it.
        connect_concurrency: ``--connect-concurrency`` if given (it wins), else ``None`` (:func:`connects`).
    """
    reserved = sum(engine_cores(s) for s in specs)
    front = max(cpus - reserved, 0.0)
    api: dict[str, int] = {}
    source: dict[str, str] = {}
    for s in specs:
        dp = _dp(s)
        given = vllm_arg(s.args(), "--api-server-count", "-asc")
        if given is not None and given.isdigit():
            api[s.served_name], source[s.served_name] = int(given), "vllm_args"
        elif any(has_flag(s.args(), f) for f in _VLLM_DECIDES) or not _multi_api_allowed():
            api[s.served_name], source[s.served_name] = dp, "vllm"
        else:
            share = front / 2 / len(specs)
            api[s.served_name] = min(max(round(share), dp), MAX_API_SERVERS_PER_ENGINE * dp)
            source[s.served_name] = "auto"
    if workers is None:
        # With no vLLM here (a fleet's front: --upstream or --router) no API servers need the half
        # the rule keeps for them: the workers, translating every token, get it.
        share = front / 4 if vllm_here else front / 2
        chosen, wsource = min(max(round(share), 1), MAX_AUTO_WORKERS), "auto"
    else:
        chosen, wsource = workers, "--workers"
    if connect_concurrency is not None:
        opening, osource = connect_concurrency, "--connect-concurrency"
    else:
        opening, osource = connects(list(api.values()), chosen)
    return Plan(cpus, cpus_source, chosen, wsource, api, source, connects=opening, connects_source=osource)


def connects(api_servers: list[int], workers: int) -> tuple[int, str]:
    """``(connections each worker opens at once to one vLLM server, why)``: :data:`CONNECTS_PER_API_SERVER`
    per API server of the model with the fewest (each model is a server of its own), at most
    :data:`MAX_CONNECTS` over the ``workers``, at least :data:`MIN_CONNECTS_PER_WORKER`; ``api_servers``
    empty (not known: ``--upstream``, ``--router``, models started on demand): :data:`MAX_CONNECTS` over
    the workers."""
    if api_servers:
        total = min(CONNECTS_PER_API_SERVER * min(api_servers), MAX_CONNECTS)
        why = f"auto: {CONNECTS_PER_API_SERVER} per vLLM API server ({min(api_servers)}), at most {MAX_CONNECTS}, over {workers} worker(s)"
    else:
        total = MAX_CONNECTS
        why = f"auto: vLLM's API servers not known here, {MAX_CONNECTS} over {workers} worker(s)"
    return max(total // workers, MIN_CONNECTS_PER_WORKER), why


def _multi_api_allowed() -> bool:
    """vLLM refuses several API servers with runtime LoRA updating, and runs one with its Rust front end."""
    lora = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
    return not lora and not os.environ.get("VLLM_RUST_FRONTEND_PATH")


def with_api_servers(spec: ModelConfig, plan_: Plan) -> ModelConfig:
    """``spec`` with ``--api-server-count N`` added to its vLLM arguments when vllama chose N
    and N differs from vLLM's own default (the data-parallel size)."""
    n = plan_.api_servers.get(spec.served_name)
    if plan_.api_servers_source.get(spec.served_name) != "auto" or n is None or n == _dp(spec):
        return spec
    return spec.model_copy(update={"vllm_args": [*spec.vllm_args, "--api-server-count", str(n)]})


def resolve(settings: Settings, specs: list[ModelConfig]) -> tuple[Settings, Plan]:
    """The settings with ``workers`` made a number, and the :class:`Plan` behind it, for the
    launched models ``specs`` (library names resolved: ``models/resolved.py``).

    ``--cpus`` replaces the detected CPUs; ``--workers N`` and ``--api-server-count`` after ``--``
    (or in a model's ``vllm_args``) win over the automatic choice. The engine cores' CPUs come
    from the real affinity (``--pin-engine-core``), whatever ``--cpus`` says.
    """
    if settings.cpus is not None:
        cpus, source = settings.cpus, "--cpus"
    else:
        cpus, source = usable_cpus()
    p = plan(cpus, source, specs, None if settings.workers == "auto" else int(settings.workers),
             vllm_here=settings.upstream_url is None,
             connect_concurrency=None if settings.connect_concurrency == "auto" else int(settings.connect_concurrency))
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity to set
        affinity = []
    mode = settings.pin_engine_core if affinity else "off"
    engines = pinned_engines(specs) if mode != "off" else {}
    placement = plan_placement(mode, affinity, min(cpus, len(affinity) or cpus), engines)
    p = dataclasses.replace(p, placement=placement)
    return settings.model_copy(update={"workers": p.workers}), p
