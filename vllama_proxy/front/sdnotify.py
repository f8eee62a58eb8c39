"""systemd service notifications (``sd_notify(3)``) for ``vllama serve`` under ``Type=notify``.

vllama tells systemd (``deploy/systemd/vllama.service``) ``STATUS=<state>: <reason>`` on every
supervisor transition; ``READY=1`` once every model has settled (the proxy listens before vLLM is
launched); ``STOPPING=1`` once at shutdown; ``WATCHDOG=1`` every ``WatchdogSec/2`` from
:func:`run_watchdog` while the supervisor's task lives (``WATCHDOG=trigger`` if it died). One
``KEY=VALUE`` datagram to ``$NOTIFY_SOCKET``, after the reference implementation in sd_notify(3),
"Notes" (why not a package: ``docs/decisions.md``). Invariants: without ``$NOTIFY_SOCKET`` all is a
no-op; a failed send is logged, never raised; like ``sd_notify(unset_environment=1)``,
:class:`Notifier` removes ``NOTIFY_SOCKET``/``WATCHDOG_*`` once read, so no child inherits them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from vllama_proxy.logs import get_logger
from vllama_proxy.supervisor.states import State

if TYPE_CHECKING:  # pragma: no cover
    from vllama_proxy.supervisor.lifecycle import Supervisor
    from vllama_proxy.supervisor.pool import ModelPool

log = get_logger("vllama.sdnotify")

#: The variables systemd sets for a ``Type=notify`` service with ``WatchdogSec=``.
ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

#: systemd keeps STATUS= short in ``systemctl status``; longer text is cut here.
MAX_STATUS = 1024


class Notifier:
    """Sends sd_notify messages to ``$NOTIFY_SOCKET``; does nothing when it is unset.

    Args:
        environ: where to read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC``, ``WATCHDOG_PID``
            (default ``os.environ``).
        unset_environment: remove those variables from ``environ`` after reading them,
            so child processes do not inherit them (``sd_notify``'s ``unset_environment``).
    """

    def __init__(self, environ: MutableMapping[str, str] | None = None, *, unset_environment: bool = True) -> None:
        env = os.environ if environ is None else environ
        self.address: str | None = env.get("NOTIFY_SOCKET") or None
        self._watchdog_usec = env.get("WATCHDOG_USEC")
        self._watchdog_pid = env.get("WATCHDOG_PID")
        if unset_environment:
            for name in ENV_VARS:
                env.pop(name, None)
        if self.address is not None and not self.address.startswith(("/", "@")):
            # sd_notify(3) accepts an absolute path or an abstract name only
            log.warning("notify_socket_unsupported", address=self.address)
            self.address = None
        self._sock: socket.socket | None = None
        self._stopping_sent = False
        self._failed = False

    @property
    def enabled(self) -> bool:
        """True when running under systemd with a notification socket."""
        return self.address is not None

    def notify(self, message: str) -> bool:
        """Send one datagram (``KEY=VALUE`` lines); True if it was sent."""
        if self.address is None:
            return False
        target: str | bytes = self.address
        if self.address.startswith("@"):
            target = b"\0" + self.address[1:].encode()  # Linux abstract namespace
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.settimeout(2.0)  # systemd reads at once; never wedge the loop
            self._sock.sendto(message.encode(), target)
        except OSError as e:
            if not self._failed:  # say it once, not every watchdog ping
                log.warning("sd_notify_failed", address=self.address, message=message.split("\n", 1)[0], error=str(e))
            self._failed = True
            return False
        self._failed = False
        log.debug("sd_notify", message=message)
        return True

    def ready(self) -> bool:
        """``READY=1``: start-up is complete (systemd then runs units ordered after us)."""
        return self.notify("READY=1")

    def status(self, text: str) -> bool:
        """``STATUS=<text>`` (one line; shown by ``systemctl status``)."""
        return self.notify("STATUS=" + _one_line(text))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1`` (and ``STATUS=``): shutdown has begun. Sent once; later calls only update STATUS."""
        if self._stopping_sent:
            return self.status(status) if status else False
        self._stopping_sent = True
        return self.notify("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: keep-alive ping (needed every ``WatchdogSec``; send twice as often)."""
        return self.notify("WATCHDOG=1")

    def watchdog_trigger(self) -> bool:
        """``WATCHDOG=trigger``: act as if the watchdog expired (restart now)."""
        return self.notify("WATCHDOG=trigger")

    def watchdog_interval(self) -> float | None:
        """``WatchdogSec`` in seconds when systemd expects pings from this process, else None.

        From ``WATCHDOG_USEC``; only when ``WATCHDOG_PID`` is unset or is this process
        (as ``sd_watchdog_enabled(3)``), and only with a notification socket.
        """
        if self.address is None or not self._watchdog_usec:
            return None
        try:
            usec = int(self._watchdog_usec)
            if self._watchdog_pid and int(self._watchdog_pid) != os.getpid():
                return None
        except ValueError:
            return None
        return usec / 1e6 if usec > 0 else None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(text: str) -> str:
    # a newline would start a new KEY=VALUE assignment
    return " ".join(str(text).split())[:MAX_STATUS]


def describe(state: State, reason: str | None, served_name: str, restarts: int = 0) -> str:
    """The ``STATUS=`` text for a state: ``<state>: <reason>`` (a default reason where none is given)."""
    if not reason:
        reason = {
            State.STARTING: f"loading {served_name}" + (f" (restart {restarts})" if restarts else ""),
            State.READY: f"serving {served_name}",
            State.STOPPING: "shutting down vLLM",
            State.STOPPED: "vLLM stopped",
        }.get(state)
    return f"{state.value}: {reason}" if reason else state.value


def attach(target: Supervisor | ModelPool, notifier: Notifier) -> None:
    """Subscribe ``notifier`` to the transitions of a supervisor, or of every supervisor in a pool.

    Sends ``STATUS=`` for the current state now and on every transition (prefixed with the
    model's name when there are several), ``READY=1`` once every model has settled (been
    ready once, or is left to load on demand: unloaded or asleep; with several models,
    also failed), ``STOPPING=1`` when one becomes ``stopping``. Call it before starting them.
    """
    supervisors = list(getattr(target, "supervisors", [target]))
    configured = [s for s in supervisors if getattr(s, "slot", None) is None]  # not the on-demand slots
    many = len(configured) > 1
    settled = {id(s) for s in supervisors if s.state in (State.UNLOADED, State.SLEEPING)}
    ready_sent = False

    def text(sup: Supervisor, state: State, reason: str | None) -> str:
        line = describe(state, reason, sup.served_name, sup.restarts)
        return f"{sup.served_name}: {line}" if many or sup not in configured else line

    def ready_once_settled() -> None:
        nonlocal ready_sent
        if not ready_sent and len(settled) == len(supervisors):
            ready_sent = True
            notifier.ready()

    def listener(sup: Supervisor) -> Callable[[State, str | None], None]:
        def on_transition(state: State, reason: str | None) -> None:
            if state is State.STOPPING:
                notifier.stopping(text(sup, state, reason))
                return
            notifier.status(text(sup, state, reason))
            # With several models one that fails must not hold back the others (its STATUS says
            # why); a single model that fails never reports ready, so the start fails loudly.
            if state in (State.READY, State.UNLOADED, State.SLEEPING) or (many and state is State.FAILED):
                settled.add(id(sup))
            ready_once_settled()

        return on_transition

    for sup in configured:
        notifier.status(text(sup, sup.state, None))
    if not configured:
        notifier.status("ready: no model configured; local models start when a request names them")
    for sup in supervisors:
        sup.listeners.append(listener(sup))
    ready_once_settled()  # nothing preloads: ready at once


async def run_watchdog(supervisor: Supervisor | ModelPool | None, notifier: Notifier) -> None:
    """Ping ``WATCHDOG=1`` every ``WatchdogSec/2`` while the supervisor's (or the pool's) task is alive.

    Returns at once when systemd expects no pings. Returns when the supervisor's task
    ends: after a normal stop quietly; after a crash (an exception, or cancelled without
    a stop) with ``STATUS=`` naming the error and ``WATCHDOG=trigger``, so systemd
    restarts the service instead of leaving a proxy that answers 503 forever.
    With ``supervisor=None`` (``--upstream``) it pings for as long as the event loop runs.
    Start it after :meth:`Supervisor.start`; cancel it on shutdown.
    """
    interval = notifier.watchdog_interval()
    if interval is None:
        return
    period = interval / 2
    log.info("sd_watchdog", interval_s=interval)
    while True:
        task: asyncio.Task[Any] | None = getattr(supervisor, "_task", None) if supervisor is not None else None
        if task is not None and task.done():
            error = "cancelled" if task.cancelled() else task.exception()
            stopped = getattr(supervisor, "_stop", None)
            if error is not None or (stopped is not None and not stopped.is_set()):
                log.error("supervisor_died", error=repr(error))
                notifier.status(f"failed: supervisor died: {error!r}")
                notifier.watchdog_trigger()
            return
        notifier.watchdog()
        await asyncio.sleep(period)
