"""Which loopback port each supervised vLLM listens on."""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Where Linux keeps the range it hands out for outgoing connections and ``bind(0)`` (``man 7 ip``).
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_given: set[int] = set()


def listen_ports() -> range | None:
    """Up to 12,000 ports just below the kernel's ephemeral range (``ip_local_port_range``; 32768-60999
    by default: 20768-32767), or ``None`` where the range cannot be read or starts too low to leave
    room (then ``bind(0)`` is used)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(max(1024, low - 12_000), low) if low > 4_096 else None


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for a vLLM started now or later.

    A vLLM's port is chosen at vllama's start and kept for its life: its restarts (a crash, a new
    adapter) and an on-demand slot's models bind it again, maybe hours later. A port from the
    ephemeral range is one the kernel also gives every outgoing connection (vllama's thousands to its
    vLLMs, a pull's downloads), so while vLLM is down one of them may take it and the next start fails
    with "address already in use". Ports below that range are never handed out so: random picks there,
    each checked free, none given twice by this process. Falls back to ``bind(0)``.
    """
    ports = listen_ports()
    for _ in range(200) if ports else ():
        port = random.choice(ports)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
